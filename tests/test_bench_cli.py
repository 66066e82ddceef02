"""``python -m sparsepipe_hpc.bench``: the dispatcher and what every benchmark shares."""

from __future__ import annotations

import pytest


def test_bench_cli_usage_errors_exit_2(tmp_path, capsys):
    """An unknown benchmark, and a --json that cannot be written, are usage errors (exit 2, one
    message), not a traceback or exit 1."""
    from sparsepipe_hpc.bench.__main__ import main
    from sparsepipe_hpc.bench.common import write_json

    with pytest.raises(SystemExit) as e:
        main(["foo"])
    assert e.value.code == 2 and "error: no benchmark 'foo'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        write_json(str(tmp_path / "no" / "dir" / "r.json"), {"a": 1})
    assert e.value.code == 2 and "cannot write it" in capsys.readouterr().err


def test_bench_help_lists_the_benchmarks_and_counts_are_checked(capsys):
    from sparsepipe_hpc.bench.__main__ import main
    from sparsepipe_hpc.bench.engine import main as engine

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "  engine     Engine benchmark:" in out and "gpu-comm" in out
    for bad, words in ((["--repeats", "0"], "--repeats: must be >= 1; got 0"),
                       (["--width", "x"], "--width: must be a whole number >= 1; got 'x'")):
        with pytest.raises(SystemExit) as e:
            engine(bad)
        assert e.value.code == 2 and words in capsys.readouterr().err
