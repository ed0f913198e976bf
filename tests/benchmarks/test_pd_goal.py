"""bench/pd_goal.py (``bench_pd --link --goal``) without servers: the link rate derived from P and
the KV bytes, the real link it stands for, the goal ratios, the log parsing (chunks per transfer,
transfer times) and the CSV / summary it writes."""

from __future__ import annotations

import argparse
import csv

import pytest

from bench import pd_goal, pd_link

#: Log lines in the connector's formats (producer.py's ``_store``, consumer.py's ``record_loaded``).
PRODUCER_LOG = """\
(Worker pid=1081) INFO 12-01 20:46:26 [producer.py:313] tritonkv: saved transfer 69b1da93… for \
cmpl-pd-f8b0-0-8e0ca5dc: 2048 tokens, 33554432 bytes, pack 27.21 ms, kv_format pages
(Worker pid=1081) INFO 12-01 20:47:01 [producer.py:313] tritonkv: saved transfer 0badcafe… \
chunk 0 (positions 0..) for cmpl-pd-aa-0-1: 256 tokens, 4194304 bytes, pack 3.10 ms, kv_format pages
(APIServer pid=1000) INFO 12-01 20:47:01 [loggers.py:1] Engine 000: Avg prompt throughput: 9.0
(Worker pid=1081) INFO 12-01 20:47:02 [producer.py:313] tritonkv: saved transfer 0badcafe… \
chunk 1 (positions 256..) for cmpl-pd-aa-0-1: 256 tokens, 4194304 bytes, pack 3.00 ms, kv_format pages
(Worker pid=1081) INFO 12-01 20:47:02 [producer.py:313] tritonkv: saved transfer 0badcafe… \
chunk 2 (positions 512..) for cmpl-pd-aa-0-1: 1536 tokens, 25165824 bytes, pack 9.00 ms, kv_format pages
(Worker pid=1081) INFO 12-01 20:47:03 [producer.py:313] tritonkv: not storing transfer 12345678… \
chunk 0 (positions 0..) for cmpl-pd-bb-0-1: it was released or aborted
"""
CONSUMER_LOG = """\
(Worker pid=1086) INFO 12-01 20:46:27 [consumer.py:525] tritonkv: loaded transfer 69b1da93… for \
cmpl-pd-f8b0-0-ab2532a9: 2047 tokens (positions 0..2046; 0 local), 33554432 bytes, fetch 50.93 ms, \
unpack 23.91 ms, kv_format pages, from 10.228.0.9:22623 ranks 0[0:4]
(Worker pid=1086) INFO 12-01 20:46:29 [consumer.py:525] tritonkv: loaded transfer 0badcafe… for \
cmpl-pd-aa-0-2: 2047 tokens (positions 0..2046; 0 local), 33554432 bytes, fetch 1400.5 ms, \
unpack 20.00 ms, kv_format pages, from 10.228.0.9:22623 ranks 0[0:4]
"""


def _row(setup, clients, ttft, itl=10.0, **extra):
    return {"setup": setup, "clients": clients, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 1.2,
            "itl_p50_ms": itl, "itl_p99_ms": itl * 2, "wrong": 0, "failed": 0, "failed_checks": 0,
            "load_text_diffs": 0, "prefill_ms": 1400.0, "prefill_in_load_ms": 1500.0,
            "transfer_p50_ms": None,
            "link_mb_per_req": 34.1, "load_before": "1 1 1", "load_after": "2 2 2",
            **pd_goal.chunk_stats({}), **extra}  # fmt: skip


def test_goal_rate_makes_the_transfer_take_the_prefill_time():
    kv, prefill_s = 2048 * pd_link.KV_BYTES_PER_TOKEN, 1.4
    rate = pd_goal.goal_rate_mbit(kv, prefill_s)
    assert rate == pytest.approx(33554432 * 8 / 1.4 / 1e6)  # 191.7 Mbit/s
    assert pd_goal.transfer_ms(kv, rate) == pytest.approx(1400.0)
    assert pd_goal.transfer_ms(kv, 2 * rate) == pytest.approx(700.0)
    for bad in ((0, 1.0), (kv, 0), (kv, -1.0)):
        with pytest.raises(ValueError, match="positive"):
            pd_goal.goal_rate_mbit(*bad)
    with pytest.raises(ValueError, match="rate_mbit"):
        pd_goal.transfer_ms(kv, 0)


def test_real_link_is_scaled_as_the_readme_scales_the_rates():
    # bench/README.md: at 1449 tok/s, 250 Mbit/s stands for 20.7 Gb/s (a 25 GbE link at TCP goodput)
    assert pd_goal.real_link_gbit(250, 1449) == pytest.approx(20.7, abs=0.05)
    # T = P here is T = P on the real deployment: 128 KiB x 15k tok/s x 8, whatever P was
    for prefill_s in (0.9, 1.4, 2.5):
        rate = pd_goal.goal_rate_mbit(2048 * pd_link.KV_BYTES_PER_TOKEN, prefill_s)
        real = pd_goal.real_link_gbit(rate, 2048 / prefill_s)
        assert real == pytest.approx(131072 * 15000 * 8 / 1e9)  # 15.7 Gb/s
    assert "25 GbE" in pd_goal.real_link_name(20.7)
    assert (
        pd_goal.real_link_name(15.7)
        == "between 10 GbE (TCP) (8.3 Gb/s) and 25 GbE (TCP) (20.7 Gb/s)"
    )
    assert pd_goal.real_link_name(2.0).startswith("below 10 GbE")
    assert pd_goal.real_link_name(500.0).startswith("above 200 Gb")
    with pytest.raises(ValueError, match="prefill_tok_s"):
        pd_goal.real_link_gbit(250, 0)


def test_goal_ratios_divide_overlap_by_the_bound_and_by_nixl():
    rows = [
        _row("colocated", 1, 1300.0),
        _row("tritonkv-pag", 1, 2900.0, itl=20.0),
        _row("tritonkv-overlap", 1, 1700.0, itl=30.0),
        _row("nixl-tuned", 1, 3000.0),
        _row("tritonkv-overlap", 2, 2500.0, itl=40.0),  # no sequential, no NIXL at 2 clients
    ]
    one, two = pd_goal.goal_ratios(rows, prefill_ms=1400.0, link_ms=1500.0)
    assert (one["setup"], one["clients"], one["decode_ms"]) == ("tritonkv-overlap", 1, 20.0)
    assert one["bound_ms"] == pytest.approx(1.2 * 1500 + 20)  # max(P, T): T here
    assert one["vs_bound"] == pytest.approx(1700 / 1820, abs=1e-3)
    assert one["vs_nixl"] == pytest.approx(1700 / 3000, abs=1e-3)
    assert one["sequential_vs_overlap"] == pytest.approx(2900 / 1700, abs=1e-3)
    assert two["decode_ms"] == 40.0  # its own ITL p50 when there is no sequential row
    assert two["vs_nixl"] is None and two["sequential_vs_overlap"] is None
    assert two["bound_ms"] == pytest.approx(1.2 * 1500 + 40)
    # P larger than T: P is the bound
    (g, _) = pd_goal.goal_ratios(rows, prefill_ms=2000.0, link_ms=1500.0)
    assert g["bound_ms"] == pytest.approx(1.2 * 2000 + 20)


def test_saved_transfers_count_the_chunks_each_transfer_was_published_in():
    saved = pd_goal.saved_transfers(PRODUCER_LOG)
    assert set(saved) == {"69b1da93…", "0badcafe…"}  # a transfer not stored is not counted
    assert saved["69b1da93…"] == pd_goal.Published(1, 2048, 33554432)
    assert saved["0badcafe…"] == pd_goal.Published(3, 2048, 33554432)
    stats = pd_goal.chunk_stats(saved)
    assert stats == {"transfers": 2, "chunks_min": 1, "chunks_p50": 2.0, "chunks_max": 3,
                     "single_chunk": 1}  # fmt: skip
    assert pd_goal.chunk_stats({})["transfers"] == 0
    assert pd_goal.transfer_times_ms(CONSUMER_LOG) == [50.93, 1400.5]
    assert pd_goal.transfer_times_ms(PRODUCER_LOG) == []
    for word in ("load", "network"):  # older logs said fetch or load
        assert pd_goal.transfer_times_ms(CONSUMER_LOG.replace(", fetch ", f", {word} ")) == [
            50.93,
            1400.5,
        ]


def test_prefill_in_load_reads_vllms_histogram_between_two_reads():
    metrics = (
        "# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase\n"
        'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3"} 1.0\n'
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 4.5\n'
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 3.0\n'
        'vllm:request_prefill_time_seconds_sum{engine="1",model_name="tiny"} 1.5\n'
        'vllm:request_prefill_time_seconds_count{engine="1",model_name="tiny"} 1.0\n'
        'vllm:request_queue_time_seconds_sum{engine="0"} 99.0\n'
    )
    assert pd_goal.prefill_histogram(metrics) == (6.0, 4.0)
    assert pd_goal.prefill_histogram("") == (0.0, 0.0)
    assert pd_goal.prefill_in_load_ms((6.0, 4.0), (10.5, 7.0)) == 1500.0
    assert pd_goal.prefill_in_load_ms((6.0, 4.0), (6.0, 4.0)) is None  # no request in between


def test_an_overlapped_row_published_in_one_piece_is_not_a_measurement():
    one_piece = pd_goal.chunk_stats(pd_goal.saved_transfers(PRODUCER_LOG.splitlines()[0]))
    chunked = pd_goal.chunk_stats({"a": pd_goal.Published(8, 2048, 1)})
    assert "1 of 1 transfers" in pd_goal.not_overlapped(
        _row("tritonkv-overlap", 1, 1.0, **one_piece)
    )
    assert "no saved transfer" in pd_goal.not_overlapped(_row("tritonkv-overlap-tok", 1, 1.0))
    assert pd_goal.not_overlapped(_row("tritonkv-overlap", 1, 1.0, **chunked)) is None
    assert pd_goal.not_overlapped(_row("tritonkv-pag", 1, 1.0, **one_piece)) is None


def _measured():
    return {
        "chunk_tokens": 256,
        "prefill_ms": 1400.0,
        "kv_bytes": 33554432,
        "rate_mbit": 191.7,
    }


def test_report_writes_the_csv_and_the_summary_with_the_goals(tmp_path):
    chunked = pd_goal.chunk_stats({"a": pd_goal.Published(8, 2048, 1)})
    rows = [
        _row("colocated", 1, 1300.0),
        _row("tritonkv-pag", 1, 2900.0, itl=20.0, transfer_p50_ms=1412.0),
        _row("tritonkv-overlap", 1, 1800.0, **chunked),
        _row("nixl-tuned", 1, 3000.0),
    ]
    assert pd_goal.report(rows, _measured(), pd_goal.QUICK | {"input_len": 2048}, tmp_path) == 0
    with open(tmp_path / "pd-goal.csv") as f:
        got = list(csv.DictReader(f))
    assert [r["setup"] for r in got] == [
        "colocated",
        "tritonkv-pag",
        "tritonkv-overlap",
        "nixl-tuned",
    ]
    assert got[2]["chunks_min"] == "8" and got[0]["rate_mbit"] == "191.7"
    assert got[0]["load_before"] == "1 1 1" and got[0]["load_after"] == "2 2 2"
    text = (tmp_path / "pd-goal-summary.txt").read_text()
    assert "--max-num-batched-tokens 256 (8 chunks a prompt)" in text
    assert "T = KV x 8 / rate = 1400 ms" in text and "15.7 Gb/s real" in text
    assert "consumer transfer p50 1412 ms" in text
    assert " 1400 " in text.splitlines()[7] and " 1500 " in text.splitlines()[7]  # P, P load
    bound = 1.2 * pd_goal.transfer_ms(33554432, 191.7) + 20.0  # T (1400.3 ms) > P
    assert f"= {round(1800 / bound, 3):g} (goal <= 1: NOT met)" in text
    assert f"= {round(1800 / 3000, 3):g} (goal <= 0.75: met)" in text
    assert "1 transfers, 8 / 8 / 8 chunks" in text and "NOT A MEASUREMENT" not in text


def test_report_fails_when_overlap_went_in_one_piece_or_an_answer_was_wrong(tmp_path):
    flat = pd_goal.chunk_stats({"a": pd_goal.Published(1, 2048, 1)})
    rows = [_row("colocated", 1, 1300.0), _row("tritonkv-overlap", 1, 1700.0, **flat)]
    assert pd_goal.report(rows, _measured(), pd_goal.QUICK, tmp_path) == 1
    text = (tmp_path / "pd-goal-summary.txt").read_text()
    assert "sequential / overlap - [NOT A MEASUREMENT OF OVERLAP]" in text  # on its goal line
    assert "1 transfers, 1 / 1 / 1 chunks (min / p50 / max): NOT A MEASUREMENT" in text
    rows = [_row("colocated", 1, 1300.0), _row("tritonkv-pag", 1, 2900.0, wrong=1)]
    assert pd_goal.report(rows, _measured(), pd_goal.QUICK, tmp_path) == 1
    unmeasured = {**_measured(), "prefill_ms": None, "kv_bytes": None, "rate_mbit": None}
    assert pd_goal.report(rows[:1], unmeasured, pd_goal.QUICK, tmp_path) == 1
    assert "were not measured" in (tmp_path / "pd-goal-summary.txt").read_text()


def test_goal_options_parse_and_a_bad_chunk_size_is_refused():
    parser = argparse.ArgumentParser()
    pd_link.add_args(parser)
    pd_goal.add_args(parser)
    args = parser.parse_args(["--link", "--goal", "--chunk-tokens", "512", "--goal-rate", "200"])
    assert (args.goal, args.chunk_tokens, args.goal_rate) == (True, 512, 200.0)
    assert parser.parse_args([]).chunk_tokens == pd_goal.CHUNK_TOKENS == 256
    for chunk in (100, 16, 2048):
        bad = argparse.Namespace(quick=True, clients=None, chunk_tokens=chunk)
        with pytest.raises(ValueError, match="chunk-tokens"):
            pd_goal.run(bad, print)
