"""The simulator: exact timings on cases worked out by hand, the real router and scheduler at
work (prefix-aware placement, preemption-free admission limits), faults, closed-loop clients,
and nothing left held in any worker's KV pool at the end."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from coordinator.router import prefix_hashes
from loadtest.config import DatasetConfig, LoadConfig, PrefixRepetitionSpec, RandomSpec
from planning.cost_model import StepCostModel
from planning.nnls import FitStats
from planning.transfer_model import TransferCostModel
from protocol.kv import KVLayout
from simulation.cluster import Simulation
from simulation.deployment import (
    Costs,
    Deployment,
    EngineLimits,
    Fault,
    Overheads,
    Scenario,
)
from simulation.report import simulated_record
from simulation.workload import SimRequest, SimulationError, TokenIds, synthetic_requests

STEP = 0.010  # seconds, every step, whatever its shape
STATS = FitStats(1, 0.0, 0, None)


def step_model(**coefficients: float) -> StepCostModel:
    coefficients = {"step": STEP, **coefficients}
    return StepCostModel(tuple(coefficients), tuple(coefficients.values()), 16, 1024, STATS)


def scenario(
    prefill: int,
    decode: int,
    *,
    num_blocks: int = 256,
    routing: str = "load",
    costs: Costs | None = None,
    overheads: Overheads | None = None,
    faults: tuple[Fault, ...] = (),
    max_num_seqs: int = 64,
) -> Scenario:
    engine = EngineLimits(num_blocks, 16, max_num_seqs, 2048)
    return Scenario(
        Deployment(prefill, decode, engine, routing),
        costs or Costs(step_model()),
        overheads or Overheads(),
        faults,
    )


def prompt(length: int, base: int, prefix: tuple[int, int] = (0, 0)) -> TokenIds:
    prefix_base, prefix_len = prefix
    return TokenIds(prefix_base, prefix_len, base, length)


def assert_nothing_held(sim: Simulation) -> None:
    for worker in sim.workers.values():
        held = [b for b in range(worker.blocks.num_blocks) if worker.blocks.ref_counts[b]]
        assert held == [], f"{worker.worker_id} still holds blocks {held[:8]}"
        assert not worker.reserved and not worker.scheduler.num_unfinished


def test_token_ids_share_exactly_their_prefix():
    a = prompt(100, 10_000, prefix=(500, 48))
    b = prompt(100, 20_000, prefix=(500, 48))
    assert len(a) == 100 and a[0] == 500 and a[47] == 547 and a[48] == 10_048
    assert a[40:56] == [540 + i for i in range(8)] + [10_048 + i for i in range(8)]
    assert list(a) == a[:] and a[-1] == a[99]
    ha, hb = prefix_hashes(a, 16), prefix_hashes(b, 16)
    assert ha[:3] == hb[:3] and ha[3] != hb[3]  # 48 shared tokens = 3 blocks
    a.append(7)
    assert len(a) == 101 and a[100] == 10_100  # made up, and new


def test_colocated_request_timing_is_one_step_per_token():
    sim = Simulation(scenario(0, 1), [SimRequest(0.0, prompt(100, 1 << 20), 5)])
    outcome = sim.run()
    (run,) = outcome.runs
    # step 1 prefills the whole prompt and samples token 1; steps 2-5 decode one token each
    assert list(run.token_times) == pytest.approx([STEP * k for k in range(1, 6)])
    assert outcome.duration_s == pytest.approx(5 * STEP)
    assert_nothing_held(sim)


def test_disaggregated_ttft_pays_the_exposed_transfer_and_handover():
    layers, per_layer = 4, 0.001  # each layer's send: 1 ms, after its layer computed
    transfer = TransferCostModel(per_layer, 0.0, STATS)
    costs = Costs(step_model(), transfer, KVLayout(layers, 4, 64, "bfloat16"))
    overheads = Overheads(handover=0.002)
    sim = Simulation(
        scenario(1, 1, costs=costs, overheads=overheads), [SimRequest(0.0, prompt(100, 1 << 20), 3)]
    )
    (run,) = sim.run().runs
    # layers computed at 2.5, 5, 7.5, 10 ms; sends end 3.5, 6, 8.5, 11 ms; +2 ms handover
    first = 0.011 + 0.002
    assert list(run.token_times) == pytest.approx([first, first + STEP, first + 2 * STEP])
    assert run.route is not None and run.route.prefill_id is None  # handed over
    assert_nothing_held(sim)


def test_a_slow_link_serializes_layers_behind_the_step():
    layers, per_layer = 4, 0.005  # sends slower than layers: the link sets the pace
    costs = Costs(
        step_model(), TransferCostModel(per_layer, 0.0, STATS), KVLayout(layers, 1, 1, "bfloat16")
    )
    sim = Simulation(scenario(1, 1, costs=costs), [SimRequest(0.0, prompt(64, 1 << 20), 1)])
    (run,) = sim.run().runs
    assert run.token_times[0] == pytest.approx(0.0025 + 4 * per_layer)


def test_batched_steps_cost_what_the_model_says():
    # 2 ms per decoding sequence: two requests decoding together take 10 + 4 ms a step
    sim = Simulation(
        scenario(0, 1, costs=Costs(step_model(decode_seqs=0.002))),
        [SimRequest(0.0, prompt(32, 1 << 20), 3), SimRequest(0.0, prompt(32, 1 << 21), 3)],
    )
    outcome = sim.run()
    for run in outcome.runs:  # one prefill step for both, then two decode steps of 14 ms
        assert list(run.token_times) == pytest.approx([0.010, 0.024, 0.038])


def token_times(base: Scenario, requests: list[SimRequest], **deployment: object) -> list[float]:
    """Every request's token times, in request order, on `base` with its deployment changed."""
    changed = replace(base, deployment=replace(base.deployment, **deployment))
    sim = Simulation(changed, requests)
    outcome = sim.run()
    assert_nothing_held(sim)
    return [t for run in outcome.runs for t in run.token_times]


def test_workers_sharing_host_cores_slow_each_other_down():
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 3), SimRequest(0.0, prompt(32, 1 << 21), 3)]

    def times(host_cores: float | None) -> list[float]:
        return token_times(scenario(0, 2), requests, host_cores=host_cores)

    alone = [0.010, 0.020, 0.030] * 2  # a device each: one request per worker, 10 ms steps
    assert times(None) == pytest.approx(alone)
    assert times(2.0) == pytest.approx(alone)  # a core each
    # One core: worker 0 starts first and alone (10 ms); every later step starts while the
    # other worker is in a step, and takes twice its time.
    assert times(1.0) == pytest.approx([0.010, 0.030, 0.050, 0.020, 0.040, 0.060])


def test_workers_pacing_their_cores_step_on_their_share_of_them():
    """Two workers pacing two cores (kernels/core_share.py): a step runs on both while the
    other worker has no work (10 ms, the 2-thread model) and on one while it has (16 ms), and
    a step in progress changes pace when the other worker starts or stops having work."""
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 3), SimRequest(0.025, prompt(32, 1 << 21), 3)]
    costs = Costs(step_model(), by_threads={1: step_model(step=0.016), 2: step_model()})
    base = scenario(0, 2, costs=costs)
    # A alone on worker 0: 0-10-20 ms, its third step from 20 ms on two threads. B reaches
    # worker 1 at 25 ms: both have work, one thread each. Workers re-pace between layers, so
    # the rest of a step in progress moves to the new count: A's third step is half done and
    # takes half of 16 ms more (ends at 33 ms); B's first step (16 ms on one thread) is half done
    # when A goes idle, and takes half of 10 ms more (ends at 38 ms); then 10 ms steps.
    assert token_times(base, requests, paced_cores=2) == pytest.approx(
        [0.010, 0.020, 0.033, 0.038, 0.048, 0.058]
    )
    assert token_times(base, requests) == pytest.approx(  # not paced: the default model
        [0.010, 0.020, 0.030, 0.035, 0.045, 0.055]
    )
    # A worker never runs on more threads than a model was fitted on: 4 cores, the 2-thread one.
    assert token_times(base, requests, paced_cores=4)[3:] == pytest.approx([0.035, 0.045, 0.055])


def test_more_paced_workers_computing_than_cores_share_them():
    """Three workers pacing two cores, all computing: one thread each, three threads on two
    cores, so every step takes 1.5 times the one-thread model (16 ms -> 24 ms)."""
    requests = [SimRequest(0.0, prompt(32, base << 20), 3) for base in (1, 2, 3)]
    costs = Costs(step_model(), by_threads={1: step_model(step=0.016), 2: step_model()})
    times = token_times(scenario(0, 3, costs=costs), requests, paced_cores=2)
    assert times == pytest.approx([0.024, 0.048, 0.072] * 3)
    assert token_times(scenario(0, 3, costs=costs), requests, paced_cores=3) == pytest.approx(
        [0.016, 0.032, 0.048] * 3  # a core each: the one-thread model as it is
    )


def test_a_paced_prefill_step_speeds_up_when_the_decode_worker_goes_idle():
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 3), SimRequest(0.025, prompt(32, 1 << 21), 3)]
    costs = Costs(step_model(), by_threads={1: step_model(step=0.016), 2: step_model()})
    # A: prefilled alone on both cores (0-10 ms), then decoded alone (10-20, 20- ms). B's prompt
    # reaches the prefill worker at 25 ms: one core each. A's last step is half done (ends at
    # 33 ms), then the decode worker idles and B's prefill step, half done, takes both cores
    # for the rest (ends at 38 ms); B then decodes alone.
    assert token_times(scenario(1, 1, costs=costs), requests, paced_cores=2) == pytest.approx(
        [0.010, 0.020, 0.033, 0.038, 0.048, 0.058]
    )


def test_steps_draw_the_measured_spread_around_the_model():
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 4), SimRequest(0.0, prompt(32, 1 << 21), 4)]
    base = scenario(0, 1)
    assert token_times(base, requests, step_noise=(2.0,), prefill_step_noise=(2.0,)) == (
        pytest.approx([0.020, 0.040, 0.060, 0.080] * 2)  # every step twice the model's 10 ms
    )
    assert token_times(base, requests, prefill_step_noise=(3.0,)) == pytest.approx(
        [0.030, 0.040, 0.050, 0.060] * 2  # only the step with prompt tokens draws it
    )
    spread = token_times(base, requests, step_noise=(0.5, 1.0, 3.0))
    gaps = {round(b - a, 6) for a, b in zip(spread[:3], spread[1:4], strict=True)}
    assert gaps <= {0.005, 0.010, 0.030} and len(gaps) > 1  # each step draws one
    assert token_times(base, requests, step_noise=(0.5, 1.0, 3.0)) == spread  # seeded
    noisy = replace(base, deployment=replace(base.deployment, step_noise=(0.5, 1.0, 3.0)))
    other_draws = [
        [
            t
            for run in Simulation(noisy, requests, noise_seed=seed).run().runs
            for t in run.token_times
        ]
        for seed in (2, 3, 4)
    ]
    assert any(times != spread for times in other_draws)  # another seed, other draws
    with pytest.raises(SimulationError, match="step_noise"):
        replace(base.deployment, step_noise=(0.0,))
    # NaN cores read as unlimited ones, a negative or NaN objective went unchecked
    for bad in ({"host_cores": float("nan")}, {"late_after_s": -1.0},
                {"late_after_s": float("nan")}):  # fmt: skip
        with pytest.raises(SimulationError, match="must be a finite number"):
            replace(base.deployment, **bad)


def test_paced_steps_draw_the_spread_measured_on_their_thread_count():
    """Three workers pacing two cores step on one thread each (1.5x the one-thread model's 16
    ms); a step draws the spread of its thread count and kind, else the pooled one."""
    requests = [SimRequest(0.0, prompt(32, base << 20), 3) for base in (1, 2, 3)]
    costs = Costs(step_model(), by_threads={1: step_model(step=0.016), 2: step_model()})
    base = scenario(0, 3, costs=costs)
    one_thread = {1: ((2.0,), ())}  # decode steps on one thread: twice the model
    assert token_times(base, requests, paced_cores=2, thread_noise=one_thread) == pytest.approx(
        [0.024, 0.072, 0.120] * 3  # the prompt step has no spread of its own: none drawn
    )
    pooled = {"prefill_step_noise": (3.0,), "step_noise": (5.0,)}
    assert token_times(
        base, requests, paced_cores=2, thread_noise=one_thread, **pooled
    ) == pytest.approx([0.072, 0.120, 0.168] * 3)  # the prompt step falls back to the pooled
    two_threads = {2: ((2.0,), (2.0,))}  # no step runs on two threads
    assert token_times(base, requests, paced_cores=2, thread_noise=two_threads) == pytest.approx(
        [0.024, 0.048, 0.072] * 3
    )
    with pytest.raises(SimulationError, match="step_noise"):
        replace(base.deployment, thread_noise={1: ((0.0,), ())})


def test_costs_take_the_model_fitted_on_the_most_threads_up_to_the_count():
    one, two = step_model(step=0.02), step_model(step=0.01)
    costs = Costs(step_model(step=0.05), by_threads={1: one, 2: two})
    assert costs.step_on(1) is one and costs.step_on(2) is two and costs.step_on(8) is two
    assert Costs(two).step_on(1) is two  # no per-thread models: the one model


def test_pacing_and_sharing_cores_are_exclusive():
    engine = EngineLimits(64)
    with pytest.raises(SimulationError, match="not both"):
        Deployment(1, 1, engine, paced_cores=2, host_cores=2.0)
    with pytest.raises(SimulationError, match="at least 1"):
        Deployment(1, 1, engine, paced_cores=0)


def test_a_decode_step_beside_a_prefill_step_takes_the_measured_slowdown():
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 5), SimRequest(0.015, prompt(32, 1 << 21), 3)]

    def times(interference: float) -> list[float]:
        return token_times(scenario(1, 1), requests, prefill_interference=interference)

    # A prefilled 0-10 ms, then decodes in 10 ms steps; B prefills 15-25 ms and joins the
    # decode batch at the next step.
    assert times(1.0) == pytest.approx([0.010, 0.020, 0.030, 0.040, 0.050, 0.025, 0.040, 0.050])
    # The decode step starting at 20 ms does so while B's prefill step runs, to 25 ms: 3x
    # slower for those 5 ms, its own pace after them (5 + 10 - 5/3 ms).
    step = 0.005 + 0.010 - 0.005 / 3
    a3, a4, a5 = 0.020 + step, 0.030 + step, 0.040 + step
    assert times(3.0) == pytest.approx([0.010, 0.020, a3, a4, a5, 0.025, a4, a5])
    # The simulator counts that step (benchmarks/simulator_fidelity.py compares the share).
    base = scenario(1, 1)
    sim = Simulation(replace(base, deployment=replace(base.deployment, prefill_interference=3.0)),
                     requests)  # fmt: skip
    sim.run()
    decode = sim.workers["decode-0"]
    assert (decode.steps_beside, decode.num_steps) == (1, 4)  # steps at 10, 20, 50, 60 ms


def test_a_decode_step_is_slowed_only_while_the_prefill_step_beside_it_lasts():
    # Steps of 10 ms + 1 ms per row up to 16 rows: a 32-token prefill 26 ms, a decode step of
    # one or two sequences 11 or 12 ms.
    costs = Costs(step_model(small_batch_rows=0.001))
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 5), SimRequest(0.015, prompt(32, 1 << 21), 3)]
    base = replace(scenario(1, 1), costs=costs)
    times = token_times(base, requests, prefill_interference=2.0)
    # A prefills 0-26 ms; B waits, then prefills 26-52 ms. A's decode step starting at 26 ms
    # ends inside B's prefill (2 x 11 = 22 ms); the one starting at 48 ms is slowed for 4 ms,
    # doing 2 of its 11 ms, then runs the other 9 alone: it ends at 61 ms, not 70. B joins the
    # next step.
    assert times == pytest.approx([0.026, 0.048, 0.061, 0.073, 0.085, 0.052, 0.073, 0.085])


def test_a_prefill_step_beside_a_decode_step_takes_the_measured_slowdown():
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 5), SimRequest(0.015, prompt(32, 1 << 21), 3)]
    times = token_times(scenario(1, 1), requests, decode_interference=2.0)
    # B's prefill step starts at 15 ms, inside A's decode step (10-20 ms): 2 x 10 ms, so its
    # first token comes at 35 ms and it joins the decode step that starts at 40 ms. A's own
    # steps are not slowed (prefill_interference is 1).
    assert times == pytest.approx([0.010, 0.020, 0.030, 0.040, 0.050, 0.035, 0.050, 0.060])


def test_measured_interference_factors_are_drawn_the_same_way_every_run():
    requests = [SimRequest(0.0, prompt(32, 1 << 20), 5), SimRequest(0.015, prompt(32, 1 << 21), 3)]
    base = scenario(1, 1)
    one = token_times(base, requests, prefill_interference=(3.0,))
    assert one == token_times(base, requests, prefill_interference=3.0)
    drawn = token_times(base, requests, prefill_interference=(2.0, 4.0))
    assert drawn == token_times(base, requests, prefill_interference=(2.0, 4.0))
    # The one slowed step (A's, starting at 20 ms beside B's prefill, to 25 ms) drew 2 or 4.
    slowed = (0.005 + 0.010 - 0.005 / 2, 0.005 + 0.010 - 0.005 / 4)
    assert drawn[2] - drawn[1] in tuple(pytest.approx(x) for x in slowed)


def test_max_concurrency_sends_the_next_request_when_one_finishes():
    requests = [SimRequest(0.0, prompt(32, (i + 1) << 20), 2) for i in range(3)]
    sim = Simulation(scenario(0, 1), requests, LoadConfig(max_concurrency=1))
    runs = sim.run().runs
    assert [r.sent_at for r in runs] == pytest.approx([0.0, 0.020, 0.040])
    assert [r.finished_at for r in runs] == pytest.approx([0.020, 0.040, 0.060])


def test_admission_respects_max_num_seqs():
    requests = [SimRequest(0.0, prompt(16, (i + 1) << 20), 4) for i in range(4)]
    sim = Simulation(scenario(0, 1, max_num_seqs=2), requests)
    runs = sim.run().runs
    firsts = sorted(r.token_times[0] for r in runs)
    assert firsts[:2] == pytest.approx([STEP, STEP])  # two admitted at once
    assert firsts[2] == pytest.approx(5 * STEP)  # the others wait for a slot


def test_cost_routing_sends_a_cached_prefix_back_to_its_worker():
    shared = (1 << 30, 256)
    first = SimRequest(0.0, prompt(288, 1 << 20, shared), 4)
    later = SimRequest(2.5, prompt(288, 1 << 21, shared), 4)  # after a stats poll
    others = [SimRequest(2.4, prompt(288, (5 + i) << 20), 64) for i in range(1)]
    sim = Simulation(scenario(0, 2, routing="cost"), [first, *others, later])
    runs = sim.run().runs
    assert runs[0].token_times and runs[2].token_times
    chosen = {w.worker_id: w.blocks.prefix_hits for w in sim.workers.values()}
    assert max(chosen.values()) == 256  # the second prompt found all 256 prefix tokens cached
    assert_nothing_held(sim)


def test_a_dead_decode_worker_turns_into_retries_not_lost_requests():
    load = LoadConfig(request_rate=20.0, seed=1)
    requests = synthetic_requests(DatasetConfig(RandomSpec(64, 32), 40, seed=1), load)
    sim = Simulation(scenario(1, 2, faults=(Fault(0.5, "decode-0"),)), requests, load)
    outcome = sim.run()
    done = [r for r in outcome.runs if r.error is None]
    assert len(done) == 40
    assert all(len(r.token_times) == r.request.output_len for r in done)
    assert any(r.attempts for r in done)  # some were on decode-0 when it died
    after = [r for r in done if r.finished_at > 0.5]
    assert after and all(r.route is not None and r.route.decode_id != "decode-0" for r in after)
    # Forgotten as the coordinator forgets a worker that left: no load, no cached prefixes.
    assert "decode-0" not in sim.router.decode and not sim.router.is_alive("decode-0")
    for worker in sim.workers.values():
        if worker.alive:
            assert not worker.reserved and not worker.scheduler.num_unfinished
            assert worker.blocks.num_free_blocks == worker.blocks.num_blocks


def test_no_live_decode_worker_fails_requests_instead_of_hanging():
    load = LoadConfig(request_rate=10.0)
    requests = synthetic_requests(DatasetConfig(RandomSpec(32, 16), 10), load)
    faults = (Fault(0.2, "worker-0"),)
    outcome = Simulation(scenario(0, 1, faults=faults), requests, load).run()
    errors = [r.error for r in outcome.runs]
    assert all(e is not None for e in errors[3:])  # after the death nothing can serve
    assert outcome.num_unsent == 0


@pytest.mark.parametrize("deployment", [(0, 1), (1, 1)])
def test_a_request_longer_than_the_context_is_a_400_not_a_hang(deployment):
    # 64 blocks of 16: a context of 1,024 tokens. As the server does (protocol/limits.py,
    # coordinator/api/prompts.py), a prompt that fills it is refused and an output stops at its
    # end; the simulator used to run such requests forever.
    requests = [
        SimRequest(0.0, prompt(1024, 1 << 20), 5),  # no room for one output token
        SimRequest(0.0, prompt(1000, 1 << 21), 25),  # 1,025 tokens: 24 of its output fit
        SimRequest(0.0, prompt(1000, 1 << 22), 24),  # exactly the context: served
        SimRequest(0.0, prompt(10, 1 << 23), 1025),  # max_tokens past the context itself
    ]
    sim = Simulation(scenario(*deployment, num_blocks=64), requests, LoadConfig(max_duration_s=60))
    outcome = sim.run()
    too_long, cut, fits, asks_too_much = outcome.runs
    assert asks_too_much.error == (
        "HTTP 400 Bad Request: max_tokens is 1025, more than this model's context (1024 tokens)"
    )
    assert too_long.error == (
        "HTTP 400 Bad Request: the prompt has 1024 tokens; this server serves at most 1024 "
        "tokens of context, prompt and output together"
    )
    assert not too_long.token_times
    assert cut.error is None and len(cut.token_times) == 24
    assert fits.error is None and len(fits.token_times) == 24
    assert_nothing_held(sim)


def test_the_record_has_tandem_bench_keys():
    load = LoadConfig(request_rate=8.0)
    spec = PrefixRepetitionSpec(num_prefixes=2, prefix_len=64, suffix_len=32, output_len=8)
    requests = synthetic_requests(DatasetConfig(spec, 16), load)
    sc = scenario(1, 2, routing="cost")
    outcome = Simulation(sc, requests, load).run()
    record = simulated_record(outcome, sc, load, dataset_name=spec.name)
    for key in ("completed", "output_throughput", "median_ttft_ms", "p99_itl_ms", "itls"):
        assert key in record
    assert record["completed"] == 16 and record["failed"] == 0
    assert record["total_output_tokens"] == 16 * 8
    assert len(record["itls"]) == 16 and all(len(i) == 7 for i in record["itls"])
    assert record["simulation"]["deployment"] == "1P2D"
    assert math.isclose(record["median_itl_ms"], STEP * 1000)


def test_a_role_switch_places_reserved_and_running_requests_again():
    load = LoadConfig(request_rate=30.0, seed=2)
    requests = synthetic_requests(DatasetConfig(RandomSpec(400, 24), 60, seed=2), load)
    sim = Simulation(scenario(1, 2, overheads=Overheads(role_switch=0.1)), requests, load)
    sim.at(0.6, sim.switch_role, "decode-0", "prefill")
    outcome = sim.run()
    assert all(r.error is None for r in outcome.runs)
    assert any(r.attempts for r in outcome.runs)  # decode-0 held some when it moved
    assert sim.workers["decode-0"].pool == "prefill" and sim.workers["decode-0"].alive
    assert "decode-0" in sim.router.prefill and "decode-0" not in sim.router.decode
    assert_nothing_held(sim)


def test_a_paced_step_in_progress_is_void_once_its_worker_switches_pools():
    """A decode step in progress when its worker moves to the prefill pool is over for good:
    the worker keeps no paced step from before the switch that another worker's re-pacing
    could re-time (and so revive, with the new epoch, as a phantom step in the new pool)."""
    load = LoadConfig(request_rate=30.0, seed=2)
    requests = synthetic_requests(DatasetConfig(RandomSpec(400, 24), 60, seed=2), load)
    costs = Costs(step_model(), by_threads={1: step_model(step=0.016), 2: step_model()})
    base = scenario(1, 2, costs=costs, overheads=Overheads(role_switch=0.002))
    paced = replace(base, deployment=replace(base.deployment, paced_cores=2))
    sim = Simulation(paced, requests, load)
    worker = sim.workers["decode-0"]
    seen: dict[str, object] = {}

    def switch() -> None:
        seen["stepping"] = worker.paced is not None and worker.step_ends_at > sim.now
        sim.switch_role("decode-0", "prefill")
        seen["after"] = (worker.paced, worker.step_ends_at <= sim.now)

    sim.at(0.605, switch)
    outcome = sim.run()
    assert seen["stepping"]  # the switch came mid-step
    assert seen["after"] == (None, True)
    assert all(r.error is None for r in outcome.runs)
    assert_nothing_held(sim)


def test_a_request_waiting_for_decode_blocks_is_not_routed_until_one_could_take_it():
    load = LoadConfig(request_rate=50.0, seed=5)
    requests = synthetic_requests(DatasetConfig(RandomSpec(400, 64), 20, seed=5), load)
    outcomes, routed = [], []
    for shortcut in (True, False):
        sim = Simulation(scenario(1, 2, num_blocks=70), requests, load)  # ~2 prompts per worker
        if not shortcut:
            sim._no_decode_room = lambda run: False
        calls: list[int] = []
        route = sim.router.route
        sim.router.route = lambda *args, _calls=calls, _route=route, **kw: (
            _calls.append(1) or _route(*args, **kw)
        )
        outcomes.append(sim.run())
        routed.append(len(calls))
        assert_nothing_held(sim)
    fast, slow = outcomes
    assert all(r.error is None for r in fast.runs)
    assert [list(r.token_times) for r in fast.runs] == [list(r.token_times) for r in slow.runs]
    assert routed[0] == 20 and routed[1] > 20  # each routed once; without: again when woken


def test_requests_waiting_for_decode_room_are_placed_in_arrival_order():
    load = LoadConfig(request_rate=50.0, seed=5)
    requests = synthetic_requests(DatasetConfig(RandomSpec(400, 64), 20, seed=5), load)
    sim = Simulation(scenario(1, 2, num_blocks=70), requests, load)  # ~2 prompts per worker
    order: list[int] = []
    placed = sim.router.placed
    first_of = {tuple(r.prompt_ids[:8]): i for i, r in enumerate(requests)}
    sim.router.placed = lambda route, ids, hashes=None: (
        order.append(first_of[tuple(ids[:8])]) or placed(route, ids, hashes)
    )
    outcome = sim.run()
    assert all(r.error is None for r in outcome.runs)
    assert order == sorted(order) and len(order) == 20  # none overtook one that waited longer
    waited = [r for r in outcome.runs if r.first_token_at - r.sent_at > 0.5]
    assert len(waited) > 5  # (most of them did wait)
    assert len(sim.room) == 0
    assert_nothing_held(sim)


def test_decode_headroom_keeps_long_outputs_from_preempting():
    """Long outputs on a small decode pool: admitting on the prompt's blocks alone fills the
    pool and preempts (recomputing whole prompts on the decode worker); with growth room kept
    per request, none is preempted and all finish sooner at the tail."""
    load = LoadConfig(request_rate=20.0, seed=3)
    requests = synthetic_requests(DatasetConfig(RandomSpec(200, 160), 30, seed=3), load)
    results = {}
    for headroom in (0, 256):
        base = scenario(1, 1, num_blocks=80)
        engine = replace(base.deployment.engine, decode_headroom_tokens=headroom)
        sim = Simulation(
            replace(base, deployment=replace(base.deployment, engine=engine)), requests, load
        )
        outcome = sim.run()
        assert all(r.error is None and r.num_output == 160 for r in outcome.runs)
        assert_nothing_held(sim)
        preempted = sum(r.decode_seq.num_preemptions for r in outcome.runs)
        results[headroom] = (preempted, outcome.duration_s)
    assert results[0][0] > 0 and results[256][0] == 0


def test_under_overload_late_waiters_let_newer_requests_be_on_time():
    """A burst beyond the decode pool's room: first come first served makes nearly everyone
    late once the line is long; newest-first while the oldest is late keeps more on time (the
    late ones still finish)."""
    load = LoadConfig(request_rate=30.0, seed=4)
    requests = synthetic_requests(DatasetConfig(RandomSpec(200, 96), 60, seed=4), load)
    on_time = {}
    for late_after in (None, 0.5):
        base = scenario(1, 1, num_blocks=120)
        deployment = replace(base.deployment, late_after_s=late_after)
        sim = Simulation(replace(base, deployment=deployment), requests, load)
        outcome = sim.run()
        assert all(r.error is None and r.num_output == 96 for r in outcome.runs)
        assert_nothing_held(sim)
        on_time[late_after] = sum(r.first_token_at - r.sent_at <= 0.5 for r in outcome.runs)
    assert on_time[0.5] > on_time[None] + 5


def test_under_prefill_overload_late_prompts_let_newer_ones_be_on_time():
    """The prefill worker is the bottleneck (decode has room for everyone): its scheduler's line
    first come first served makes nearly everyone late once it is long; with the TTFT
    objective the newest goes first while the oldest is late, and more are on time (the late
    ones still finish, and nothing is left held)."""
    load = LoadConfig(request_rate=20.0, seed=5)  # twice what the prefill worker serves
    requests = synthetic_requests(DatasetConfig(RandomSpec(1000, 8), 80, seed=5), load)
    costs = Costs(step_model(large_batch_rows=0.0001))  # a 1,000-token prompt: ~0.11 s
    on_time = {}
    for late_after in (None, 0.5):
        base = scenario(1, 1, num_blocks=2000, costs=costs, max_num_seqs=2)
        deployment = replace(base.deployment, late_after_s=late_after)
        sim = Simulation(replace(base, deployment=deployment), requests, load)
        outcome = sim.run()
        assert all(r.error is None and r.num_output == 8 for r in outcome.runs)
        assert_nothing_held(sim)
        assert not sim.room.late_after_s or len(sim.room) == 0
        on_time[late_after] = sum(r.first_token_at - r.sent_at <= 0.5 for r in outcome.runs)
    assert on_time[0.5] > on_time[None] + 10
