"""--save-result targets that cannot be written are refused before a run, and a record that
cannot be written where asked is kept in the working folder instead of lost."""

import json

import pytest

from loadtest.config import ResultFile
from loadtest.errors import BenchError
from loadtest.results import check_result_target, save_record


def test_a_result_dir_that_is_a_file_is_refused(tmp_path) -> None:
    (tmp_path / "taken").write_text("x")
    with pytest.raises(BenchError, match="--result-dir"):
        check_result_target(ResultFile(directory=tmp_path / "taken"))


def test_a_result_file_that_is_a_folder_is_refused(tmp_path) -> None:
    (tmp_path / "out.json").mkdir()
    with pytest.raises(BenchError, match="is a folder"):
        check_result_target(ResultFile(directory=tmp_path, filename="out.json"))
    check_result_target(ResultFile(directory=tmp_path / "new", filename="r.json"))  # made now
    assert (tmp_path / "new").is_dir()


def test_a_result_file_under_a_file_is_refused_before_the_run(tmp_path) -> None:
    """--result-path f/x.json where f is a file passed the check, and failed after the run."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(BenchError, match="cannot be made: .*f is a file"):
        check_result_target(ResultFile(filename=str(tmp_path / "f" / "deeper" / "x.json")))
    check_result_target(ResultFile(filename=str(tmp_path / "new" / "x.json")))  # made later


def test_a_record_that_cannot_be_written_is_kept_in_the_working_folder(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(BenchError, match="the result is in tandem-result-") as raised:
        save_record({"completed": 3}, tmp_path / "file" / "r.json")  # its parent is a file
    kept = str(raised.value).rsplit(" ", 1)[-1]
    assert json.loads((tmp_path / kept).read_text()) == {"completed": 3}


def test_a_plot_folder_that_cannot_be_made_is_refused_before_the_run(tmp_path, capsys) -> None:
    """bench (and bench compare) found out only after the whole run, with a bare exception."""
    from cli.main import main

    (tmp_path / "taken").write_text("x")
    closed = "http://127.0.0.1:9"  # never reached: the --plot check comes first
    argv = ["bench", "--base-url", closed, "--model", "m", "--plot", str(tmp_path / "taken")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tandem bench: error: --plot {tmp_path / 'taken'} cannot be used")
    argv = ["bench", "compare", "a.json", "b.json", "--plot", str(tmp_path / "taken")]
    assert main(argv) == 1
    assert "--plot" in capsys.readouterr().err
