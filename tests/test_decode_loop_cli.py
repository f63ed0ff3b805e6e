"""bench/decode_loop.py runs end to end on CPU (eager twin) and writes JSON, a plot and the table."""
from __future__ import annotations

import json

from bench import decode_loop


def test_cli_tiny_cpu_run_writes_json_png_and_table(tmp_path, capsys):
    out = tmp_path / "dl"
    assert decode_loop.main(["--device", "cpu", "--concurrency", "1,4", "--steps", "4", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    runs = {(r["variant"], r["concurrency"]): r for r in data["results"]}
    assert set(runs) == {(v, c) for v in ("plain", "spec", "dynamic", "dynamic_eager_plain") for c in (1, 4)}
    assert all(r["tokens"] > 0 and r["graph_misses"] == 0 for r in runs.values())
    assert runs[("spec", 1)]["mean_accept"] > 1
    assert runs[("dynamic", 4)]["match_vs_plain"]["identical"] in (None, 1.0)
    assert out.with_suffix(".png").stat().st_size > 1000
    text = capsys.readouterr().out
    assert "eager twin" in text and text.rstrip().splitlines()[-1].startswith("targets:")


def test_help_exits_cleanly(capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        decode_loop.parse_args(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
