"""`specloom report`: rows, ratios and the chart from bench reports; a report without peers is one clear line."""

from __future__ import annotations

import json

from test_cli import assert_clean_error, run_in_process
from specloom.bench.peer_report import markdown, rows_of

REPORT = {
    "model": "smollm2-135m", "command": "specloom bench smollm2-135m ...", "dtype": "bf16", "num_prompts": 4,
    "max_tokens": 16, "candidate": "eagle3", "candidate_tokens_per_second": 30.0, "mean_accepted_length": 1.8,
    "candidate_identical_to_specloom_plain": 4, "host": {"cpu": "AMD EPYC", "kind": "avx2", "threads": 2},
    "peers": {
        "plain": {"label": "specloom plain", "tokens_per_second": 20.0, "identical_to_specloom_plain": 4,
                  "num_prompts": 4},
        "llama.cpp": {"label": "llama.cpp", "tokens_per_second": 80.0, "identical_to_specloom_plain": 3,
                      "num_prompts": 4, "mean_accepted_length": None},
        "hf-lookup": {"label": "HF prompt lookup", "tokens_per_second": 10.0, "identical_to_specloom_plain": 4,
                      "num_prompts": 4, "mean_accepted_length": 1.4},
    },
}


def test_rows_and_ratios():
    rows = {r["name"]: r for r in rows_of(REPORT)}
    assert list(rows) == ["specloom plain", "specloom eagle3", "llama.cpp", "HF prompt lookup"]
    assert rows["specloom eagle3"]["ratio_to_plain"] == 1.5 and rows["llama.cpp"]["ratio_to_plain"] == 4.0
    assert rows["specloom eagle3"]["ratio_to_best_peer"] == 30.0 / 80.0  # the best peer is llama.cpp
    assert rows["HF prompt lookup"]["tau"] == 1.4 and rows["llama.cpp"]["identical"] == 3
    md = markdown([("r.json", REPORT)])
    assert "| specloom eagle3 | 30.0 | 1.50× | 0.38× | 1.80 | 4/4 |" in md
    assert "| llama.cpp | 80.0 | 4.00× | 1.00× | – | 3/4 |" in md


def test_report_command_writes_markdown_and_chart(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(REPORT))
    rc, out, err = run_in_process(capsys, "report", str(tmp_path / "peers.md"), "--bench", str(tmp_path / "a.json"))
    assert rc == 0, err
    assert (tmp_path / "peers.png").stat().st_size > 1000
    assert "## smollm2-135m" in (tmp_path / "peers.md").read_text()


def test_report_of_a_run_without_peers_is_one_line(tmp_path, capsys):
    (tmp_path / "old.json").write_text(json.dumps({"candidate_tokens_per_second": 1.0}))
    rc, _, err = run_in_process(capsys, "report", str(tmp_path / "x.md"), "--bench", str(tmp_path / "old.json"))
    assert_clean_error(rc, err, "not a `specloom bench --baseline ... --json` report with peers")
    rc, _, err = run_in_process(capsys, "report", str(tmp_path / "x.md"), "--bench", str(tmp_path / "missing.json"))
    assert_clean_error(rc, err, "missing.json: not a readable bench report")
