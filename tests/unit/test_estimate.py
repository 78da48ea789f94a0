"""Estimator: service-time prediction from priors, refined by observed service times."""

from __future__ import annotations

import random

import pytest

from extproc.core.estimate import Estimator, Job
from extproc.policy.schema import Estimation, ModelCost

DEFAULT = ModelCost(prefill_ms_per_token=0.05, decode_ms_per_token=10.0, overhead_ms=20.0)
BIG = ModelCost(prefill_ms_per_token=0.2, decode_ms_per_token=40.0, overhead_ms=50.0)


def config(**overrides: object) -> Estimation:
    values: dict[str, object] = {
        "default": DEFAULT,
        "models": {"big": BIG},
        "learning_rate": 0.1,
        "occupancy_slowdown": 1.0,
        "chars_per_token": 4.0,
        "default_max_tokens": 256,
    }
    values.update(overrides)
    return Estimation.model_validate(values)


def service_time(cost: ModelCost, job: Job, slowdown: float, decode_ms: float) -> float:
    """What a backend with the given true decode cost would take, in seconds."""
    ms = (cost.overhead_ms + job.prompt_tokens * cost.prefill_ms_per_token
          + job.output_tokens * decode_ms * slowdown)
    return ms / 1000.0


def test_prediction_formula() -> None:
    estimator = Estimator(config())
    job = Job(None, prompt_tokens=1000, output_tokens=100)
    assert estimator.predict(job, 0.0) == pytest.approx((20 + 1000 * 0.05 + 100 * 10.0) / 1000)
    assert estimator.predict(job, 0.5) == pytest.approx((20 + 1000 * 0.05 + 100 * 10.0 * 1.5) / 1000)


def test_prediction_grows_with_prompt_output_and_occupancy() -> None:
    estimator = Estimator(config())
    base = estimator.predict(Job(None, 100, 100), 0.2)
    assert estimator.predict(Job(None, 10_000, 100), 0.2) > base
    assert estimator.predict(Job(None, 100, 1000), 0.2) > base
    assert estimator.predict(Job(None, 100, 100), 0.9) > base
    predictions = [estimator.predict(Job(None, 100, 100), occ / 10) for occ in range(11)]
    assert predictions == sorted(predictions)
    assert len(set(predictions)) == len(predictions)


def test_occupancy_is_clamped_to_zero_one() -> None:
    estimator = Estimator(config())
    job = Job(None, 100, 100)
    assert estimator.predict(job, 5.0) == estimator.predict(job, 1.0)
    assert estimator.predict(job, -3.0) == estimator.predict(job, 0.0)
    assert estimator.slowdown(0.5) == pytest.approx(1.5)


def test_per_model_priors() -> None:
    estimator = Estimator(config())
    big = (50 + 1000 * 0.2 + 100 * 40) / 1000
    default = (20 + 1000 * 0.05 + 100 * 10) / 1000
    assert estimator.predict(Job("big", 1000, 100), 0.0) == pytest.approx(big)
    assert estimator.predict(Job("small", 1000, 100), 0.0) == pytest.approx(default)
    assert estimator.predict(Job(None, 1000, 100), 0.0) == estimator.predict(Job("small", 1000, 100), 0.0)
    assert estimator.decode_ms_per_token("big") == 40.0
    assert estimator.decode_ms_per_token("anything") == 10.0


def test_job_from_body_facts() -> None:
    estimator = Estimator(config())
    assert estimator.job("m", prompt_chars=400, prompt_tokens=None, max_tokens=50) == Job("m", 100, 50)
    # Exact token ids win over the character estimate.
    assert estimator.job("m", prompt_chars=400, prompt_tokens=7, max_tokens=50) == Job("m", 7, 50)
    # Unknown max_tokens: the policy default; 0 still costs one token.
    assert estimator.job(None, 0, None, None) == Job(None, 0, 256)
    assert estimator.job(None, 0, None, 0) == Job(None, 0, 1)
    assert estimator.job(None, 0, -5, None).prompt_tokens == 0


def test_a_token_limit_is_never_sized_above_max_output_tokens() -> None:
    estimator = Estimator(config(max_output_tokens=4096))
    assert estimator.job("m", 0, None, 4096).output_tokens == 4096
    assert estimator.job("m", 0, None, 5000).output_tokens == 4096
    # A limit 400 digits long (JSON allows it) is predictable, not an overflow.
    huge = estimator.job("m", 0, None, 10**400)
    assert huge.output_tokens == 4096
    assert estimator.predict(huge, 1.0) == pytest.approx((20 + 4096 * 10.0 * 2) / 1000)


def test_an_unread_body_is_the_largest_job_the_policy_expects() -> None:
    """Its output is max_output_tokens, never default_max_tokens, and it costs what the costliest
    model would (the body that would name the model is unread)."""
    estimator = Estimator(config(max_output_tokens=2000))
    unread = estimator.job(None, prompt_chars=8000, prompt_tokens=None, max_tokens=None, unreadable=True)
    assert unread == Job(None, 2000, 2000, unread=True)
    assert estimator.sized_as(unread, 0.0) == "big"
    biggest_readable = max(estimator.predict(estimator.job(model, 8000, None, tokens), occ)
                           for model in (None, "big", "other") for tokens in (None, 10, 2000, 10**6)
                           for occ in (0.0, 1.0))
    assert estimator.predict(unread, 1.0) == pytest.approx(biggest_readable)
    assert estimator.predict(unread, 1.0) == pytest.approx((50 + 2000 * 0.2 + 2000 * 40 * 2) / 1000)
    # A model from a header is known: its own costs.
    assert estimator.sized_as(estimator.job("small", 0, None, None, unreadable=True), 0.0) == "small"


def test_the_costliest_model_may_be_the_default() -> None:
    estimator = Estimator(config(models={"tiny": {"decode_ms_per_token": 1.0}}))
    unread = estimator.job(None, 0, None, None, unreadable=True)
    assert estimator.sized_as(unread, 0.5) is None
    assert estimator.predict(unread, 0.0) == pytest.approx((20 + 32768 * 10.0) / 1000)


def test_an_unread_job_teaches_nothing() -> None:
    estimator = Estimator(config(learning_rate=0.5))
    unread = estimator.job(None, 0, None, None, unreadable=True)
    before = estimator.predict(Job(None, 0, 100), 0.0)
    for _ in range(20):
        estimator.observe(unread, 0.0, 0.05)  # it answered at once: its size was a guess
    assert estimator.learned() == {}
    assert estimator.predict(Job(None, 0, 100), 0.0) == before


def test_the_safe_choice_is_the_default() -> None:
    defaults = Estimation()
    assert (defaults.unreadable_body, defaults.max_output_tokens) == ("estimate", 32768)
    assert defaults.max_output_tokens >= defaults.default_max_tokens


@pytest.mark.parametrize("model", [None, "big"])
def test_learning_converges_to_the_observed_cost(model: str | None) -> None:
    estimator = Estimator(config(learning_rate=0.1))
    rng = random.Random(7)
    cost = BIG if model == "big" else DEFAULT
    true_decode = cost.decode_ms_per_token * 2.7  # the prior is far off

    def error() -> float:
        return abs(estimator.decode_ms_per_token(model) - true_decode) / true_decode

    errors = [error()]
    for _ in range(200):
        job = Job(model, rng.randint(0, 4000), rng.randint(1, 1000))
        occupancy = rng.random()
        estimator.observe(job, occupancy, service_time(cost, job, estimator.slowdown(occupancy), true_decode))
        errors.append(error())
    assert errors[0] > 0.5
    assert errors[20] < errors[0]
    assert errors[-1] < 0.01
    # The prediction itself now matches what the backend does.
    job = Job(model, 500, 300)
    actual = service_time(cost, job, estimator.slowdown(0.4), true_decode)
    assert abs(estimator.predict(job, 0.4) - actual) / actual < 0.10
    key = model or "*"
    assert estimator.learned()[key][1] == 200


def test_learning_tracks_noisy_observations() -> None:
    estimator = Estimator(config(learning_rate=0.05))
    rng = random.Random(11)
    true_decode = 6.0
    for _ in range(500):
        job = Job(None, rng.randint(0, 2000), rng.randint(50, 500))
        occupancy = rng.random()
        exact = service_time(DEFAULT, job, estimator.slowdown(occupancy), true_decode)
        observed = exact * rng.uniform(0.8, 1.2)
        estimator.observe(job, occupancy, observed)
    assert abs(estimator.decode_ms_per_token(None) - true_decode) / true_decode < 0.10


def test_outlier_moves_the_estimate_at_most_one_clipped_step() -> None:
    alpha = 0.1
    estimator = Estimator(config(learning_rate=alpha))
    job = Job(None, 100, 100)
    estimator.observe(job, 0.0, 1e9)  # a stuck request: a billion seconds
    assert estimator.decode_ms_per_token(None) == pytest.approx((1 - alpha) * 10.0 + alpha * 10.0 * 4)
    high = estimator.decode_ms_per_token(None)
    estimator.observe(job, 0.0, 1e-9)  # faster than its own overhead
    assert estimator.decode_ms_per_token(None) == pytest.approx((1 - alpha) * high + alpha * high / 4)


def test_learning_rate_zero_disables_learning() -> None:
    estimator = Estimator(config(learning_rate=0.0))
    job = Job("big", 100, 100)
    before = estimator.predict(job, 0.3)
    for _ in range(50):
        estimator.observe(job, 0.3, 100.0)
    assert estimator.predict(job, 0.3) == before
    assert estimator.learned() == {}


@pytest.mark.parametrize("service", [0.0, -1.0])
def test_non_positive_service_time_is_ignored(service: float) -> None:
    estimator = Estimator(config())
    estimator.observe(Job(None, 1, 1), 0.0, service)
    assert estimator.learned() == {}


def test_unknown_models_share_one_key() -> None:
    estimator = Estimator(config())
    rng = random.Random(3)
    for i in range(1000):
        name = f"client-model-{rng.getrandbits(64):x}-{i}"
        estimator.observe(Job(name, 10, 10), 0.0, 0.05)
    estimator.observe(Job(None, 10, 10), 0.0, 0.05)
    estimator.observe(Job("big", 10, 10), 0.0, 0.5)
    learned = estimator.learned()
    assert set(learned) == {"*", "big"}
    assert learned["*"][1] == 1001
    assert learned["big"][1] == 1
    # Every unknown name (and no name) reads the same shared estimate.
    shared = estimator.decode_ms_per_token(None)
    assert shared != 10.0
    assert estimator.decode_ms_per_token("never-seen") == shared


def test_learning_for_one_model_does_not_move_another() -> None:
    estimator = Estimator(config())
    for _ in range(30):
        estimator.observe(Job("big", 0, 100), 0.0, 10.0)
    assert estimator.decode_ms_per_token("big") > 40.0
    assert estimator.decode_ms_per_token(None) == 10.0


def test_reconfigure_keeps_what_was_learned() -> None:
    estimator = Estimator(config())
    for _ in range(30):
        estimator.observe(Job(None, 0, 100), 0.0, 0.02 + 100 * 0.003)
    learned = estimator.decode_ms_per_token(None)
    assert learned < 5.0
    estimator.reconfigure(config(default=ModelCost(decode_ms_per_token=99.0)))
    assert estimator.decode_ms_per_token(None) == learned
    assert estimator.decode_ms_per_token("big") == 40.0
