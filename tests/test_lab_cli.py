"""The lab's command line: bad input ends in one line and exit status 2 (never a traceback), ``--block-size`` reads
Mooncake-format traces of other blocks, ``ladder`` prints and writes the ladder, and the command starts without
torch or transformers (it replays traces without a model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.lab.__main__ import main

ROOT = Path(__file__).parents[1]


def line(**fields: object) -> str:
    row = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1], **fields}
    return json.dumps(row) + "\n"


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the command expecting argparse's error: exit status 2, one line on stderr after the usage. Returns it."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


BAD_TRACES = {
    "missing": (None, "No such file or directory"),
    "16-token blocks": (line(input_length=100, hash_ids=list(range(7))), "but 7 ids; the file does not say its block"),
    "block_size 4.0": (line(block_size=4.0), "block_size must be an integer >= 1, got 4.0"),
    "block_size 0": (line(block_size=0), "block_size must be an integer >= 1, got 0"),
    "block_size true": (line(block_size=True), "block_size must be an integer >= 1, got True"),
    "input_length true": (line(input_length=True), "input_length must be an integer >= 1, got True"),
    "timestamp text": (line(timestamp="x"), "timestamp must be an integer >= 0, got 'x'"),
    "output_length -5": (line(output_length=-5), "output_length must be an integer >= 0, got -5"),
    "ids true": (line(hash_ids=[True]), "hash_ids must be integers"),
    "empty": ("", "no requests"),
}


@pytest.mark.parametrize("command", [[], ["ladder"]], ids=["curves", "ladder"])
@pytest.mark.parametrize("case", BAD_TRACES)
def test_a_bad_trace_is_one_line_and_exit_status_2(case, command, tmp_path, capsys):
    content, message = BAD_TRACES[case]
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    error = fails([*command, str(path), "--capacity", "1", "--processes", "1"], capsys)
    assert error.startswith("python -m astrai.lab") and message in error


def test_bad_options_are_one_line_and_exit_status_2(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(line(block_size=4))
    assert "must be >= 1, got 0" in fails([str(path), "--block-size", "0"], capsys)
    assert "not an integer: '4.0'" in fails(["ladder", str(path), "--capacity", "1", "--block-size", "4.0"], capsys)
    assert "t.jsonl:1: block_size 4, but --block-size is 16" in fails([str(path), "--block-size", "16"], capsys)
    assert "--capacity" in fails(["ladder", str(path)], capsys)
    assert "invalid choice: 'belady'" in fails(["ladder", str(path), "--capacity", "1", "--policy", "belady"], capsys)


def test_block_size_reads_a_trace_of_other_blocks(tmp_path, capsys):
    """Two requests of 100 tokens in 16-token blocks (7 ids, 6 full): the second reuses all 6 full blocks."""
    path = tmp_path / "vllm.jsonl"
    path.write_text(line(input_length=100, hash_ids=list(range(7))) * 2)
    assert main([str(path), "--block-size", "16", "--capacity", "10", "--policy", "lru", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["traces"]
    assert report["block_size"] == 16 and report["ceiling"]["hit_tokens"] == 6 * 16


def test_the_ladder_command_prints_and_writes_the_ladder(tmp_path, capsys):
    path = tmp_path / "vllm.jsonl"
    path.write_text(line(input_length=100, hash_ids=list(range(7))) * 2)
    csv, html = tmp_path / "l.csv", tmp_path / "l.html"
    argv = ["ladder", str(path), "--block-size", "16", "--capacity", "10", "--json", "--csv", str(csv)]
    assert main([*argv, "--html", str(html), "--processes", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {name: rung["tokens"] for name, rung in data["rungs"].items()} == {
        "prompt_tokens": 200,
        "reachable": 192,  # 6 full blocks each; 4 tokens in a partial block each
        "ceiling": 96,
        "belady": 96,
        "lru": 96,
    }
    assert csv.read_text().startswith("kind,name,cause,tokens,share\nrung,prompt_tokens,,200,1.0\n")
    assert "<svg" in html.read_text()
    assert main(["ladder", str(path), "--block-size", "16", "--capacity", "10", "--processes", "1"]) == 0
    assert "never_seen: 96 tokens (48.00%): new 96, diverged 0" in capsys.readouterr().out


def test_the_ladder_command_takes_a_second_tier(tmp_path, capsys):
    """A, B, A (blocks of 2 tokens and one more each) on 2 pages and a tier 2 of 1 block written on_evict: the tier
    serves the last A (tests/test_ladder.py's case by hand); its rung is in the text, the JSON, CSV and HTML."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(line(timestamp=t, input_length=3, hash_ids=[ids, 9 + t]) for t, ids in enumerate([1, 2, 1]))
    )
    csv, html = tmp_path / "l.csv", tmp_path / "l.html"
    argv = ["ladder", str(path), "--block-size", "2", "--capacity", "2", "--tier2", "1", "--write", "on_evict"]
    assert main([*argv, "--json", "--csv", str(csv), "--html", str(html), "--processes", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["tier2"], data["write"]) == (1, "on_evict")
    assert {name: rung["tokens"] for name, rung in data["rungs"].items()} == {
        "prompt_tokens": 9,
        "reachable": 6,
        "ceiling": 2,
        "belady (C1 + C2)": 2,
        "lru + tier 2": 2,
        "lru": 0,
    }
    assert "gap,tier,,2," in csv.read_text() and "tier 2 of 1 blocks written on_evict" in html.read_text()
    assert main([*argv, "--processes", "1"]) == 0
    text = capsys.readouterr().out
    assert "lru at 2 cached pages, tier 2 of 1 blocks written on_evict" in text
    assert "tier: 2 tokens (22.22%): loaded_from_tier2 2, pool_hits_changed 0" in text


def test_a_bad_second_tier_is_one_line_and_exit_status_2(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(line(block_size=4))
    ladder = ["ladder", str(path), "--capacity", "2", "--processes", "1"]
    assert "--tier2: must be >= 0, got -1" in fails([*ladder, "--tier2", "-1"], capsys)
    assert "--write: invalid choice: 'back'" in fails([*ladder, "--tier2", "4", "--write", "back"], capsys)
    assert "--write is tier 2's write policy: give --tier2" in fails([*ladder, "--write", "on_evict"], capsys)


def test_the_command_starts_without_torch():
    """A fresh interpreter runs the lab's commands on a trace and has imported neither torch nor transformers."""
    script = (
        "import sys\n"
        "from astrai.lab.__main__ import main\n"
        "main(['assets/traces/synthetic_trace.jsonl', '--capacity', '10', '--policy', 'lru', '--processes', '1'])\n"
        "main(['ladder', 'assets/traces/synthetic_trace.jsonl', '--capacity', '10', '--processes', '1'])\n"
        "main(['assets/traces/synthetic_trace.jsonl', '--capacity', '10', '--tier2', '20', '--processes', '1'])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
