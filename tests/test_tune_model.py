"""tune's cost models: the overlap formula against a step-by-step schedule, and fits that recover their parameters."""

import numpy as np
import pytest

from weightstream.bench.calibrate import MISS_STEPS, fresh_sets, miss_levels, partial_sets
from weightstream.sim.cost_model import fit_cost_model, fit_line
from weightstream.sim.overlap_model import (
    CostParams,
    Measurements,
    StepLoad,
    dense_seconds,
    expert_cache_step_s,
    fit_cost_params,
    fit_read_line,
    layer_seconds,
    page_cache_step_s,
)


def scheduled(n: int, m: int, c: float, lat: float, r: float) -> float:
    """One compute thread: resident experts first, then each miss once it has landed (FIFO arrivals)."""
    finish = (n - m) * c
    for i in range(1, m + 1):
        finish = max(finish, lat + i * r) + c
    return finish


def test_layer_formula_is_the_schedule():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 12))
        m = int(rng.integers(0, n + 1))
        c, lat, r = rng.uniform(0.0001, 0.02, 3)
        assert float(layer_seconds(n, m, c, lat, r)) == pytest.approx(scheduled(n, m, c, lat, r), rel=1e-12)


TRUE = CostParams(
    dense_s=0.040,
    dense_per_token_s=0.0015,
    expert_call_s=0.0007,
    expert_row_s=0.00004,
    read_latency_s=0.0009,
    read_s_per_mib=0.0008,
    nonoverlap_s_per_mib=0.00005,
    page_cache_s_per_mib=0.0031,
    page_cached_per_byte=1.3,
    layer_fixed_s=0.0011,
    page_limit_s_per_mib=0.0019,
    page_readahead=[[0, 16 * 2**20]],
)


def synthetic_measurements(
    p: CostParams, layers=16, k=8, mib=12.0, prefill=32, miss_per_layer=8.0, levels=(1, 2)
) -> Measurements:
    """What calibration would time on a machine that follows the model exactly with parameters `p`."""
    one = StepLoad(np.array([1]), np.full((1, layers), k), np.zeros((1, layers)), k)
    pre = StepLoad(np.array([prefill]), np.full((1, layers), k), np.zeros((1, layers)), k)
    miss = StepLoad(np.array([1]), np.full((1, layers), k), np.full((1, layers), miss_per_layer), k)

    def partial(m):
        return StepLoad(np.array([1]), np.full((1, layers), k), np.full((1, layers), float(m)), k)

    page = StepLoad(np.array([1]), np.full((1, layers), k), np.full((1, layers), k), k)
    expert_decode = layers * (p.layer_fixed_s + k * (p.expert_call_s + p.expert_row_s))
    expert_one = layers * (p.layer_fixed_s + p.expert_call_s + p.expert_row_s)
    expert_prefill = layers * (p.layer_fixed_s + k * (p.expert_call_s + prefill * p.expert_row_s))
    batches = [1, 2, 4, 8, 1, 2, 4, 8]
    return Measurements(
        layers=layers,
        top_k=k,
        decode_step_s=float(expert_cache_step_s(p, one, mib)[0]),
        decode_expert_s=expert_decode,
        decode_one_expert_s=expert_one,
        prefill_tokens=prefill,
        prefill_step_s=float(expert_cache_step_s(p, pre, mib)[0]),
        prefill_expert_s=expert_prefill,
        read_batches=batches,
        read_seconds=[p.read_latency_s + b * mib * p.read_s_per_mib for b in batches],
        read_mib_per_expert=mib,
        miss_step_s=float(expert_cache_step_s(p, miss, mib)[0]),
        miss_per_layer=miss_per_layer,
        partial_miss_step_s=[float(expert_cache_step_s(p, partial(m), mib)[0]) for m in levels],
        partial_miss_per_layer=list(levels),
        page_step_s=float(page_cache_step_s(p, page, mib)[0]),
        page_missed_mib=layers * k * mib,
        page_cached_per_byte=p.page_cached_per_byte,
        page_readahead=p.page_readahead,
        # at its limit every MiB read in (expert bytes x readahead) is first reclaimed
        page_limit_step_s=float(page_cache_step_s(p, page, 0.0)[0])
        + p.page_limit_s_per_mib * layers * k * mib * p.page_cached_per_byte,
        page_limit_evicted_mib=layers * k * mib * p.page_cached_per_byte,
    )


@pytest.mark.parametrize("miss_per_layer", [8.0, 3.5])
def test_fit_recovers_the_parameters_from_synthetic_timings(miss_per_layer):
    fitted = fit_cost_params(synthetic_measurements(TRUE, miss_per_layer=miss_per_layer))
    for name, value in TRUE.to_dict().items():
        if name == "page_readahead":  # measured bytes, carried as they are
            assert fitted.page_readahead == value
            continue
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-12), name


def test_a_prefill_that_costs_more_a_row_than_a_decode_expert_keeps_the_decode_experts_cost():
    """Native kernels run a 32-row prefill by dequantizing the weight, at more a row than one whole decode expert
    (calibrated on the 16-layer Q4_K checkpoint: 0.33 ms a row against 0.17 ms an expert). The fit keeps c1 =
    expert_call_s + expert_row_s, so a resident decode step is priced as it was timed."""
    m = synthetic_measurements(TRUE)
    per_expert = (m.decode_expert_s - m.decode_one_expert_s) / (m.layers * (m.top_k - 1))
    fixed = m.decode_one_expert_s / m.layers - per_expert
    m.prefill_expert_s = m.layers * (fixed + m.top_k * 40 * m.prefill_tokens * per_expert)  # 40x an expert a row
    fitted = fit_cost_params(m)
    assert fitted.expert_call_s + fitted.expert_row_s == pytest.approx(per_expert, rel=1e-9)
    one = StepLoad(np.array([1]), np.full((1, m.layers), m.top_k), np.zeros((1, m.layers)), m.top_k)
    assert float(expert_cache_step_s(fitted, one, 12.0)[0]) == pytest.approx(m.decode_step_s, rel=1e-9)


def test_the_non_overlapped_term_is_fitted_over_every_miss_level():
    """Older calibrations (all-miss only) still fit; where the levels disagree, the fit lies between them and, on
    relative error, as near the partial levels (a cache that mostly hits) as the all-miss one."""
    assert fit_cost_params(synthetic_measurements(TRUE, levels=())).nonoverlap_s_per_mib == pytest.approx(
        TRUE.nonoverlap_s_per_mib
    )
    steep = CostParams.from_dict({**TRUE.to_dict(), "nonoverlap_s_per_mib": 0.0004})
    m = synthetic_measurements(TRUE)
    m.miss_step_s = synthetic_measurements(steep).miss_step_s  # all-miss pays 8x the partial levels' term
    g = fit_cost_params(m).nonoverlap_s_per_mib
    assert TRUE.nonoverlap_s_per_mib < g < 0.0004
    assert g - TRUE.nonoverlap_s_per_mib < 0.0004 - g  # the partial levels, two of three, pull harder


def test_partial_miss_routing_misses_exactly_its_level():
    fixed = fresh_sets(64, 8, 3, seed=4)
    for m in miss_levels(8, 64):
        choose = partial_sets(lambda pos: fixed(0, pos), 64, m, 3, seed=m)
        for pos in range(3):
            resident = set(fixed(0, pos))
            seen = set()
            for step in range(MISS_STEPS + 1):
                chosen = choose(step, pos)
                fresh = set(chosen) - resident
                assert len(chosen) == len(set(chosen)) == 8 and len(fresh) == m and not fresh & seen
                seen |= fresh
    assert miss_levels(8, 64) == [1, 2] and miss_levels(2, 8) == [1] and miss_levels(4, 32) == [1, 2]
    assert miss_levels(2, 4) == []  # too few experts outside top-k for four steps without a repeat


def test_read_line_recovers_latency_and_bandwidth_through_noise():
    rng = np.random.default_rng(1)
    batches = [1, 2, 4, 8] * 5
    seconds = [0.002 + b * 0.009 + rng.normal(0, 0.0005) for b in batches]
    latency, per_expert = fit_read_line(batches, seconds)
    assert latency == pytest.approx(0.002, abs=0.0006) and per_expert == pytest.approx(0.009, rel=0.03)
    latency, per_expert = fit_read_line([1, 2, 4], [0.01, 0.019, 0.041])  # a line through below the origin
    assert latency == 0.0 and per_expert > 0
    with pytest.raises(ValueError, match="two sizes"):
        fit_read_line([4, 4], [0.1, 0.1])


def test_linear_fallback_recovers_fixed_and_per_mib():
    rng = np.random.default_rng(2)
    mib = rng.uniform(20, 400, 30)
    model = fit_cost_model(list(mib), list(0.15 + 0.0008 * mib + rng.normal(0, 0.002, 30)))
    assert model.fixed_s == pytest.approx(0.15, abs=0.003) and model.per_mib_s == pytest.approx(0.0008, rel=0.03)
    assert model.r2 > 0.95


def test_the_bench_fit_never_charges_a_negative_cost():
    """Runs whose decode got faster as they read more (noise on a busy machine) tilt a free line below 0: bench's
    fit pins the slope at 0 (and the intercept where the line would cross below the origin)."""
    mib = [10.0, 50.0, 100.0, 200.0]
    faster = fit_cost_model(mib, [0.30, 0.29, 0.27, 0.26])
    assert faster.per_mib_s == 0.0 and faster.fixed_s == pytest.approx(0.28)
    steep = fit_cost_model(mib, [0.001, 0.05, 0.11, 0.23])  # the free line crosses 0 above 0 MiB
    assert steep.fixed_s == 0.0 and steep.per_mib_s == pytest.approx(np.dot(mib, [0.001, 0.05, 0.11, 0.23]) / 52600)


def _nnls_by_grid(x, y) -> float:
    """The least squared error of any line with both terms at 0 or more, searched on a fine grid (no scipy here)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    best = np.inf
    for b in np.linspace(0, 2 * max(y.max(), 0) + 1e-9, 401):
        a = max(float(x @ (y - b) / (x @ x)), 0.0)  # the best slope at this intercept, held at 0 or more
        best = min(best, float(((y - b - a * x) ** 2).sum()))
    return best


def test_one_non_negative_line_fit_serves_bench_and_the_read_line():
    rng = np.random.default_rng(3)
    for _ in range(200):
        x = rng.uniform(0, 10, 6)
        y = rng.uniform(-1, 1) + rng.uniform(-1, 1) * x + rng.normal(0, 0.5, 6)
        intercept, slope = fit_line(x, y)
        assert intercept >= 0 and slope >= 0
        error = float(((y - intercept - slope * x) ** 2).sum())
        assert error <= _nnls_by_grid(x, y) + 1e-9
        assert fit_read_line(x, y) == (intercept, slope)
        model = fit_cost_model(list(x), list(y))
        assert (model.fixed_s, model.per_mib_s) == (intercept, slope)
    assert fit_line([4, 4], [0.1, 0.2]) is None and fit_cost_model([4, 4], [0.1, 0.2]) is None


def test_noise_is_not_a_negative_cost():
    m = synthetic_measurements(TRUE)
    m.miss_step_s = m.decode_step_s * 0.5  # reads faster than calibrated: nothing left to charge
    m.page_step_s = m.decode_step_s * 0.5
    fitted = fit_cost_params(m)
    assert fitted.nonoverlap_s_per_mib == 0.0 and fitted.page_cache_s_per_mib == 0.0


def test_prefill_and_page_cache_steps():
    load = StepLoad(np.array([1, 20]), np.array([[8, 8], [40, 40]]), np.array([[0, 8], [40, 10]]), 8)
    seconds = expert_cache_step_s(TRUE, load, 12.0)
    c = TRUE.expert_call_s + 20 * 8 / 40 * TRUE.expert_row_s
    r = 12.0 * TRUE.read_s_per_mib
    expected = dense_seconds(TRUE, 20) + scheduled(40, 40, c, TRUE.read_latency_s, r) + scheduled(40, 10, c, 0.0009, r)
    fixed = 2 * TRUE.layer_fixed_s
    assert seconds[1] == pytest.approx(expected + fixed + TRUE.nonoverlap_s_per_mib * 50 * 12.0)
    page = page_cache_step_s(TRUE, load, 12.0)
    one = TRUE.expert_call_s + TRUE.expert_row_s
    assert page[0] == pytest.approx(TRUE.dense_s + fixed + 16 * one + TRUE.page_cache_s_per_mib * 8 * 12.0)


def test_a_layer_of_fewer_experts_still_pays_the_blocks_fixed_seconds():
    # a replayed top-2 routing on a top-8 model (Mixtral's trace on the OLMoE shape): the fixed part of a layer,
    # spread over 8 experts at calibration, must not shrink to a quarter when only 2 are computed
    two = StepLoad(np.array([1]), np.full((1, 16), 2), np.zeros((1, 16)), 2)
    one = TRUE.expert_call_s + TRUE.expert_row_s
    expected = TRUE.dense_s + 16 * (TRUE.layer_fixed_s + 2 * one)
    assert expert_cache_step_s(TRUE, two, 12.0)[0] == pytest.approx(expected)
    skipped = StepLoad(np.array([1]), np.zeros((1, 16)), np.zeros((1, 16)), 2)  # no layer computes an expert
    assert expert_cache_step_s(TRUE, skipped, 12.0)[0] == pytest.approx(TRUE.dense_s)
