"""The step and transfer cost models: fitting known coefficients back, predicting shapes they
were not fitted on, JSON round trips, and `tandem profile` end to end on a tiny model."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planning.cost_model import (
    FEATURES,
    ProfileInfo,
    StepCostModel,
    StepShape,
    fit,
    mean_abs_pct_error,
)
from planning.model_file import CostModelError
from planning.nnls import FitStats, nnls
from planning.transfer_model import TransferCostModel
from protocol.telemetry import StepRecord

OVERHEAD_MODEL = Path("/root/.cache/tandem/models/overhead-llama-l2-h256")
ROOT = Path(__file__).resolve().parents[2]

# Seconds per unit, roughly SmolLM2-135M on two CPU cores; the knee at 128 rows.
TRUE_KNEE = 128
TRUE = {
    "step": 12e-3,
    "small_batch_rows": 200e-6,
    "large_batch": 5e-3,
    "large_batch_rows": 150e-6,
    "rows_over_knee": 80e-6,
    "prefill_step": 500e-6,
    "decode_seqs": 60e-6,
    "decode_context": 3e-6,
    "prefill_attention": 5e-9,
    "cached_attention": 170e-9,
}
TRUE_MODEL = StepCostModel(
    tuple(TRUE), tuple(TRUE.values()), 16, TRUE_KNEE, FitStats(0, 0.0, 0, None)
)


def shapes(batches, contexts, chunks, cached) -> list[StepShape]:
    """Decode steps, fresh and cached prompt chunks, and decodes mixed with a prompt chunk."""
    out = [StepShape(0, 0, b, b * c) for b in batches for c in contexts]
    out += [StepShape(t, t * (t + o), 0, 0) for t in chunks for o in (0, *cached)]
    out += [StepShape(t, t * t, b, b * contexts[0]) for b in batches[::2] for t in chunks[::2]]
    return out


TRAIN_SHAPES = shapes(
    (1, 2, 4, 8, 16, 24, 32, 48, 64), (32, 384, 1024), (8, 32, 128, 512, 2048), (512,)
)
HELDOUT_SHAPES = shapes((3, 6, 12, 20, 40), (100, 700), (12, 48, 300, 1000), (256, 1024))


def timed(shapes: list[StepShape], noise: float, seed: int = 0) -> list[StepRecord]:
    rng = random.Random(seed)
    return [
        StepRecord(0.0, TRUE_MODEL.predict(s) * (1 + rng.uniform(-noise, noise)), *s, 0, 0)
        for s in shapes
    ]


def test_fit_recovers_exact_coefficients_and_the_knee() -> None:
    model = fit(timed(TRAIN_SHAPES, 0.0))
    assert model.knee_rows == TRUE_KNEE
    fitted = dict(zip(model.features, model.coefficients, strict=True))
    for name, value in TRUE.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name
    assert model.stats.train_mae_pct < 1e-6


def test_fit_with_noise_predicts_unseen_shapes_within_one_percent() -> None:
    train, heldout = timed(TRAIN_SHAPES, 0.02), timed(HELDOUT_SHAPES, 0.0, seed=1)
    model = fit(train, heldout)
    assert model.stats.heldout_mae_pct is not None and model.stats.heldout_mae_pct < 1.0
    assert model.stats.num_train == len(train) and model.stats.num_heldout == len(heldout)
    assert mean_abs_pct_error(model, heldout) == model.stats.heldout_mae_pct


def test_coefficients_stay_non_negative_where_least_squares_would_go_negative() -> None:
    # Times that fall with more decode context: plain least squares gives that a negative cost.
    records = [StepRecord(0.0, 0.02 - 1e-6 * c, 0, 0, 4, c, 0, 0) for c in (100, 1000, 5000)]
    model = fit(records)
    assert min(model.coefficients) >= 0
    assert dict(zip(model.features, model.coefficients, strict=True))["decode_context"] == 0


def test_nnls_clamps_a_coefficient_at_zero() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    unconstrained = np.linalg.lstsq(a, np.array([1.0, -1.0, 0.0]), rcond=None)[0]
    assert unconstrained[1] < 0
    np.testing.assert_allclose(nnls(a, np.array([1.0, -1.0, 0.0])), [0.5, 0.0], atol=1e-12)


def test_mean_abs_pct_error_by_hand() -> None:
    model = StepCostModel(("step",), (0.010,), 16, 128, FitStats(0, 0.0, 0, None))
    # 10 ms predicted: 2 ms over 8 ms measured (25%), 2.5 ms under 12.5 ms (20%).
    records = [StepRecord(0.0, s, 0, 0, 1, 10, 0, 0) for s in (0.008, 0.0125)]
    assert mean_abs_pct_error(model, records) == pytest.approx(22.5)


def test_decode_steps_at_once_cost_what_each_costs_alone_to_the_last_bit() -> None:
    # The simulator's leaps price a run of decode steps in one call; a step priced alone (the
    # scheduler's path) must come out the same, or leaping would change the simulation.
    profile = Path(__file__).resolve().parents[2] / "benchmarks/profiles/llama70b-class-tp8.json"
    model = StepCostModel.load(profile)
    contexts = np.arange(1_000, 3_000_000, 7_919, dtype=np.int64)
    for num_seqs in (1, 15, 16, 17, 255):
        alone = [model.predict(StepShape(0, 0, num_seqs, int(c))) for c in contexts]
        assert model.predict_decodes(num_seqs, contexts).tolist() == alone


def test_step_model_json_round_trip_is_exact(tmp_path: Path) -> None:
    info = ProfileInfo("SmolLM2-135M-Instruct", "bfloat16", "cpu", 2, 16, "sweep")
    model = fit(timed(TRAIN_SHAPES, 0.02), timed(HELDOUT_SHAPES, 0.0, seed=1), info)
    path = tmp_path / "profile.json"
    model.save(path)
    assert StepCostModel.load(path) == model
    assert set(json.loads(path.read_text())["coefficients"]) == set(FEATURES)


@pytest.mark.parametrize(
    "text,error",
    [
        ("[]", "not a tandem.step_cost_model"),
        ('{"kind": "tandem.step_cost_model", "version": 9}', "version 9"),
        ('{"kind": "tandem.step_cost_model", "version": 1, "coefficients": {"x": 1}}', "x"),
        ("{", "not JSON"),
    ],
)
def test_bad_step_model_files_say_why(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(CostModelError, match=error):
        StepCostModel.load(path)


def test_transfer_model_fits_base_and_bandwidth(tmp_path: Path) -> None:
    def seconds(size: int) -> float:
        return 50e-6 + size / 10e9  # 50 us a message, 10 GB/s

    train = [(size, seconds(size)) for size in (4096, 65536, 1 << 20, 8 << 20)]
    heldout = [(size, seconds(size)) for size in (12288, 3 << 20)]
    model = TransferCostModel.fit(train, heldout, transport="tcp")
    assert model.base_seconds == pytest.approx(50e-6, rel=1e-6)
    assert model.seconds_per_byte == pytest.approx(1e-10, rel=1e-6)
    assert model.stats.heldout_mae_pct == pytest.approx(0, abs=1e-6)
    path = tmp_path / "transfer.json"
    model.save(path)
    assert TransferCostModel.load(path) == model
    with pytest.raises(CostModelError, match="not a tandem.step_cost_model"):
        StepCostModel.load(path)


def test_planning_loads_no_torch() -> None:
    code = (
        "import planning.cost_model, planning.records, planning.transfer_model, sys; "
        "print(' '.join(m for m in ('torch', 'ray', 'engine') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []


@pytest.mark.skipif(not OVERHEAD_MODEL.is_dir(), reason="the overhead model is not fetched")
def test_profile_quick_sweep_saves_a_loadable_model(tmp_path: Path, capsys) -> None:
    from cli.main import main

    output = tmp_path / "profile.json"
    assert (
        main(["profile", "--quick", "--model", str(OVERHEAD_MODEL), "--output", str(output)]) == 0
    )
    model = StepCostModel.load(output)
    assert model.info.model == OVERHEAD_MODEL.name and model.info.source == "sweep"
    assert model.stats.num_heldout > 0
    assert model.stats.heldout_mae_pct is not None and math.isfinite(model.stats.heldout_mae_pct)
    assert f"wrote {output}" in capsys.readouterr().out


def test_profile_from_telemetry_fits_the_records(tmp_path: Path, capsys) -> None:
    from cli.main import main

    records = timed(TRAIN_SHAPES + HELDOUT_SHAPES, 0.0)
    telemetry = tmp_path / "steps.json"
    telemetry.write_text(json.dumps([r._asdict() for r in records]))
    output = tmp_path / "profile.json"
    assert main(["profile", "--from-telemetry", str(telemetry), "--output", str(output)]) == 0
    model = StepCostModel.load(output)
    assert model.info.source == "telemetry"
    assert model.stats.num_train + model.stats.num_heldout == len(records)
    assert model.stats.heldout_mae_pct == pytest.approx(0, abs=1e-3)


@pytest.mark.parametrize(
    "content,error",
    [
        (None, "cannot read"),
        ('{"a": 1}', "expected a JSON list"),
        ('[{"seconds": 0.1}]', "record 0 lacks prefill_tokens"),
        ('[{"seconds": 0, "prefill_tokens": 1, "prefill_attention": 1, "decode_seqs": 0, '
         '"decode_context": 0}]', "has seconds 0"),
        # NaN broke the fit (an SVD that does not converge); inf fitted a model and said 0
        ('[{"seconds": NaN, "prefill_tokens": 1, "prefill_attention": 1, "decode_seqs": 0, '
         '"decode_context": 0}]', "has seconds nan"),
        ('[{"seconds": Infinity, "prefill_tokens": 1, "prefill_attention": 1, '
         '"decode_seqs": 0, "decode_context": 0}]', "has seconds inf"),
    ],
)  # fmt: skip
def test_profile_bad_telemetry_is_one_line(tmp_path: Path, capsys, content, error) -> None:
    from cli.main import main

    telemetry = tmp_path / "steps.json"
    if content is not None:
        telemetry.write_text(content)
    output = tmp_path / "profile.json"
    assert main(["profile", "--from-telemetry", str(telemetry), "--output", str(output)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem profile: error:") and error in err and err.count("\n") == 1
    assert not output.exists()


def test_profile_refuses_before_the_sweep_what_it_cannot_do(tmp_path: Path, capsys) -> None:
    """100,000 threads crashed the process (a segmentation fault after "can't start new
    thread"); an --output that is a folder was found out only after the whole sweep."""
    from cli.main import main

    model = str(tmp_path)  # never read: both are refused first
    for flags, error in (
        (["--threads", "100000"], "--threads 100000 is more than this machine's"),
        (["--output", str(tmp_path)], "is a folder: name the file"),
    ):
        assert main(["profile", "--model", model, "--quick", *flags]) == 1
        err = capsys.readouterr().err
        assert error in err and err.count("\n") == 1


@pytest.mark.skipif(not OVERHEAD_MODEL.is_dir(), reason="the overhead model is not fetched")
def test_profile_times_kv_transfer_over_gloo(tmp_path: Path, capsys) -> None:
    """A real receiver process and a real gloo channel: every size sent and timed, the model
    saved where asked and loadable, and a bigger layer never predicted cheaper."""
    from cli import profile_transfer
    from cli.main import main

    output = tmp_path / "transfer.json"
    argv = ["profile", "--quick", "--model", str(OVERHEAD_MODEL), "--transport", "gloo",
            "--transfer-only", "--transfer-output", str(output)]  # fmt: skip
    assert main(argv) == 0
    model = TransferCostModel.load(output)
    sizes = len(profile_transfer.QUICK_FIT_TOKENS) + len(profile_transfer.QUICK_HELDOUT_TOKENS)
    assert model.transport == "gloo"
    assert model.stats.num_train + model.stats.num_heldout == sizes
    assert model.base_seconds >= 0 and model.seconds_per_byte >= 0
    assert model.predict(1 << 20) >= model.predict(1 << 10) > 0
    out, err = capsys.readouterr()
    assert f"wrote {output}" in out and "KV transfer over gloo" in out
    assert err.count("profile: kv") == sizes  # one line per size, on stderr
    assert not (tmp_path / "profile.json").exists()  # --transfer-only: no step sweep


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--transfer-only"], "--transfer-only needs --transport NAME"),
        (["--transfer-only", "--transport", "gloo", "--from-telemetry", "x.json"], "exclude"),
    ],
)
def test_profile_transfer_flag_errors(argv: list[str], error: str, capsys) -> None:
    from cli.main import main

    assert main(["profile", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem profile: error:") and error in err
