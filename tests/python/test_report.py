"""bench/report.py renders what a benchmark result holds (no GPU needed)."""

import json

import torch

from conftest import REPO, import_bench


def test_warmup_section_compares_with_cudnn():
    report = import_bench("report")

    def timed(ms):
        return {"ms": ms, "tflops": 100.0}

    configs = [
        {"name": "S32K_warmup", "warmup": True, "step": timed(250.0),
         "step_with_kl_value": timed(251.0), "kl_value_share_of_step": 0.004,
         "peers": {"cudnn": {"step": timed(116.0)}}},
        {"name": "S32K_docs_warmup", "warmup": True, "step": timed(72.0),
         "step_with_kl_value": timed(72.5), "kl_value_share_of_step": 0.003, "peers": {}},
        {"name": "S32K", "warmup": False, "step": timed(28.0)},
        {"name": "S128K_warmup", "warmup": True, "skipped": "time budget"},
    ]
    text = "\n".join(report.warmup_section(configs))
    assert "| S32K_warmup | 250.00 (100) | 251.00 (100) | +0.4 % | 116.00 (100) | 2.16x |" in text
    assert "| S32K_docs_warmup |" in text and "no dense peer" in text
    assert "| S32K |" not in text and "S128K_warmup" not in text
    assert report.warmup_section(configs[2:]) == []


def test_flash_msa_peer_table_pairs_both_libraries():
    report = import_bench("report")
    run = {"first_step_s": 0.05, "step_ms": 5.7, "memory_growth_gb": 3.3,
           "bitwise_reproducible": True}
    peer = {"first_step_s": 56.1, "step_ms": 41.5, "memory_growth_gb": 0.9,
            "bitwise_reproducible": False}
    shapes = [{"name": "gh200_16K", "flash_msa": run, "flash_msa_0_1_1": peer, "speedup": 7.28,
               "selection": {"rows_with_the_same_blocks": 0.8412}},
              {"name": "paper_128K", "flash_msa": run, "flash_msa_0_1_1": {"error": "OOM"}}]
    text = "\n".join(report.flash_msa_peer_table(shapes))
    assert ("| gh200_16K | 5.70 ms | 41.50 ms | 7.28x | 0.05 / 56.1 | 3.3 / 0.9 | True / False "
            "| 84.1 % |") in text
    assert "| paper_128K |  | OOM |" in text


def test_flash_msa_selection_in_this_library_s_form():
    peer = import_bench("against_flash_msa")
    theirs = torch.tensor([[[[2, 0, 1]], [[1, 0, 4]], [[0, 4, 4]]]], dtype=torch.int32)
    want = torch.tensor([[[[0, 1, 2]], [[0, 1, -1]], [[0, -1, -1]]]], dtype=torch.int32)
    assert torch.equal(peer.ascending(theirs, num_blocks=4), want)


def test_the_peer_is_not_the_bench_script():
    """The comparison script and Flash-MSA's renamed package had one name once, and the import
    of the package returned the script: here no Flash-MSA is installed, so there is none."""
    bench = import_bench("against_flash_msa")
    peer = bench.load_peer()
    assert peer is None or hasattr(peer, "flash_msa_func")


def test_per_stage_table_shows_the_step_s_memory_growth():
    """A run that measured the step's memory growth shows it beside the peak; older runs, which
    did not, render as before."""
    report = import_bench("report")
    res = json.loads((REPO / "bench/results/2026-12-04-h200-bench-tma.json").read_text())
    measured = next(c for c in res["configs"] if "step" in c)

    def row():
        text = report.page(res, "run.json", [], None)
        return next(line for line in text.splitlines()
                    if line.startswith(f"| {measured['name']} |") and " GiB" in line)

    assert row().endswith(f"| {measured['step_peak_memory_gb']} GiB |"), row()
    measured["step_memory_growth_gb"] = 10.3
    assert row().endswith(f"| {measured['step_peak_memory_gb']} GiB (+10.3 GB) |"), row()
