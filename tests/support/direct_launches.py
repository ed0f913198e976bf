"""Direct launches against Triton's own, without a GPU: run as a script with TRITON_INTERPRET
unset; prints one JSON object of findings (``tests/kernels/test_direct_launch.py`` asserts on it).

Kernels compile for sm_90 and launch into ``stub_driver``'s recording stub driver, so each
launch's arguments (grid, stream, compiled function, metadata, every kernel argument) can be
compared: a launch through ``JITFunction.run`` and the direct relaunch of the same call must pass
the same ones (``launch_metadata`` aside: the launcher hands it to launch hooks alone, and none is
registered).
"""

from __future__ import annotations

import json
import os

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITONKV_AUTOTUNE"] = "0"

from stub_driver import LAUNCHES, emulate_gpu_path, install_stub_driver

install_stub_driver()

import torch  # noqa: E402
import triton  # noqa: E402
from kv_cases import make_cache  # noqa: E402

from tritonkv import _index, _kv_triton, _launch, pack_kv, prepare_kv, unpack_kv  # noqa: E402
from tritonkv._index import host_seq_index  # noqa: E402

emulate_gpu_path()
JIT_RUNS = []
_run = triton.runtime.jit.JITFunction.run


def _counting_run(self, *args, **kwargs):
    JIT_RUNS.append(self.fn.__name__)
    return _run(self, *args, **kwargs)


triton.runtime.jit.JITFunction.run = _counting_run


def _normal(launch: tuple) -> list:
    """A launch's arguments with tensors as their addresses, ``launch_metadata`` left out."""
    grid_stream_function_metadata, args = launch[:6], launch[9:]
    hooks = [id(hook) for hook in launch[7:9]]
    return [*grid_stream_function_metadata, *hooks, *(_address(a) for a in args)]


def _address(value):
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _copy_twice(groups, slots, index, packed, **kw) -> dict:
    """copy_kv with the same arguments twice: the first through JITFunction.run, the second
    direct; what each launched and how many JIT runs it took."""
    found = {}
    for call in ("first", "second"):
        LAUNCHES.clear()
        JIT_RUNS.clear()
        _kv_triton.copy_kv(groups, slots, index, packed, **kw)
        found[call] = {"launches": [_normal(x) for x in LAUNCHES], "jit_runs": len(JIT_RUNS)}
    return found


def main() -> None:
    report = {"direct_enabled": _launch.DIRECT, "cases": []}
    for layout, dtype in (("flash_attn_nhd", torch.bfloat16), ("mla", torch.float16)):
        _raw, layers = make_cache(layout, dtype, num_layers=3, head_size=16)
        handle = prepare_kv(layers)
        layer_set = handle.resolve(full_check=True)
        groups = {width: layer_set.launches(width, handle.views) for width in (4, 8)}
        slots = torch.randperm(48)[:20].to(torch.int64)
        qsl = torch.tensor([0, 18, 19, 20])
        parts, heads = 1 + layer_set.has_v, layer_set.shape[1]
        room = torch.empty(3 * parts * 20 * heads * 16 + 16, dtype=dtype)  # (8 bytes off fits)
        for ids in ([2, 0], [0], [0, 1, 2]):
            index = host_seq_index(qsl, torch.tensor(ids), 20, last_only=False)
            rows = int(index.cu_seqlens[-1])
            for shift in (0, 4):  # elements: packed 16-byte aligned, then 8 bytes off
                n = 3 * parts * rows * heads * 16
                packed = room[shift : shift + n].view(3, parts, rows, heads, 16)
                for unpack, digest in ((False, False), (True, False), (False, True)):
                    lanes = torch.zeros(2, dtype=torch.int64) if digest else None
                    width = 8 if shift == 0 else 4
                    kw = {"width": width, "has_v": layer_set.has_v, "unpack": unpack}
                    found = _copy_twice(groups[width], slots, index, packed, lanes=lanes, **kw)
                    found |= {"layout": layout, "ids": ids, "shift": shift, "unpack": unpack}
                    found["digest"] = digest
                    report["cases"].append(found)
        # Another call of the same specialisation (17 rows, not 19; other index tensors): its
        # direct launch, reusing the first call's kernel, equals its own JIT launch.
        for unpack in (False, True):
            first = host_seq_index(qsl, torch.tensor([2, 0]), 20, last_only=False)
            other = host_seq_index(torch.tensor([0, 14, 17, 20]), torch.tensor([0, 2]), 20, False)
            n = 3 * parts * 17 * heads * 16
            kw = {"width": 8, "has_v": layer_set.has_v, "unpack": unpack}
            groups[8][0].direct.clear()
            _copy_twice(
                groups[8], slots, first, room[: n // 17 * 19].view(3, parts, 19, heads, 16), **kw
            )
            packed = room[:n].view(3, parts, 17, heads, 16)
            direct = _copy_twice(groups[8], slots, other, packed, **kw)["first"]
            groups[8][0].direct.clear()
            jit = _copy_twice(groups[8], slots, other, packed, **kw)["first"]
            report.setdefault("other_calls", []).append(
                {"layout": layout, "unpack": unpack, "direct": direct, "jit": jit}
            )
        # The whole call: the second pack / unpack launches the index and copy kernels directly.
        out = torch.empty(3, parts, 19, heads, 16, dtype=dtype)
        for name, call in (
            ("pack", lambda: pack_kv(handle, slots, qsl, torch.tensor([2, 0]), out=out)),  # noqa: B023
            ("unpack", lambda: unpack_kv(out, handle, slots, qsl, torch.tensor([2, 0]))),  # noqa: B023
        ):
            call()
            LAUNCHES.clear()
            JIT_RUNS.clear()
            call()
            report.setdefault("calls", []).append(
                {"layout": layout, "op": name, "launches": len(LAUNCHES), "jit_runs": len(JIT_RUNS)}
            )
    # The index kernel: a direct launch passes the same arguments as its JIT launch, its own
    # buffer's address as out_ptr.
    qsl = torch.tensor([0, 5, 9, 9, 30], dtype=torch.int32)
    ids = torch.tensor([3, 1], dtype=torch.int32)
    index_launches = []
    for _ in range(2):
        LAUNCHES.clear()
        JIT_RUNS.clear()
        index = _index.device_seq_index(qsl, ids, torch.device("cpu"), False)
        (launch,) = LAUNCHES
        index_launches.append(
            {
                "args": _normal(launch),
                "out_address": index.addresses()[0],
                "jit_runs": len(JIT_RUNS),
            }
        )
    report["index"] = index_launches
    # A launch hook registered (a profiler's): the direct launch calls it as Triton's would, with
    # the launch's metadata.
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    if hasattr(hooks, "add"):  # (a HookChain: Triton 3.9)
        hooks.add(lambda metadata: seen.append(metadata.get()["name"]))
        for _ in range(2):
            LAUNCHES.clear()
            _index.device_seq_index(qsl, ids, torch.device("cpu"), False)
            (launch,) = LAUNCHES
            launch[7](launch[6])  # what the C launcher does with the enter hook
    report["hooked"] = seen if hasattr(hooks, "add") else None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
