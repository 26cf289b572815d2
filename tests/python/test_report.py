"""bench/report.py renders what a benchmark result holds (no GPU needed)."""

from conftest import import_bench


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
