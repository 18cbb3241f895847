"""Admission: a bounded queue of waiting sequences, 503 with Retry-After when it is full, and
draining."""

from __future__ import annotations

import json

import pytest

from coordinator.api.admission import Admission
from coordinator.api.errors import ApiError


def test_needs_room_for_one_sequence() -> None:
    with pytest.raises(ValueError, match="at least one sequence"):
        Admission(0)


def test_full_queue_answers_503_with_retry_after() -> None:
    admission = Admission(max_waiting=2, retry_after_s=7)
    admission.admit()
    admission.admit()
    with pytest.raises(ApiError) as refused:
        admission.admit()
    err = refused.value
    assert (err.status, err.code, err.headers) == (503, "queue_full", {"Retry-After": "7"})
    assert err.body() == {
        "error": {
            "message": "the server is overloaded: 2 sequences are waiting to start; retry later",
            "type": "service_unavailable",
            "param": None,
            "code": "queue_full",
        }
    }
    response = err.response()
    assert (response.status_code, response.headers["retry-after"]) == (503, "7")
    assert json.loads(response.body) == err.body()
    assert (admission.num_waiting, admission.num_in_flight) == (2, 2)  # the refusal took nothing


def test_only_waiting_sequences_count_against_the_queue() -> None:
    admission = Admission(max_waiting=1)
    first = admission.admit()
    first.started()  # its first token arrived: running, no longer waiting
    second = admission.admit()
    assert (admission.num_waiting, admission.num_in_flight) == (1, 2)
    with pytest.raises(ApiError):
        admission.admit()
    second.release()
    assert (admission.num_waiting, admission.num_in_flight) == (0, 1)
    assert not admission.idle
    first.release()
    assert admission.idle


def test_started_and_release_are_idempotent() -> None:
    admission = Admission(max_waiting=3)
    ticket = admission.admit()
    other = admission.admit()
    ticket.started()
    ticket.started()
    ticket.release()
    ticket.release()
    ticket.started()
    assert (admission.num_waiting, admission.num_in_flight) == (1, 1)
    other.release()  # released while still waiting: frees the waiting slot too
    assert (admission.num_waiting, admission.num_in_flight) == (0, 0)
    assert admission.idle


def test_a_fanned_out_request_waits_once_per_sequence() -> None:
    admission = Admission(max_waiting=4)
    ticket = admission.admit(num_sequences=3)
    assert (admission.num_waiting, admission.num_in_flight) == (3, 1)
    with pytest.raises(ApiError) as refused:
        admission.admit(num_sequences=2)  # 3 + 2 > 4
    assert (refused.value.status, refused.value.code) == (503, "queue_full")
    ticket.started(1)
    ticket.started(1)
    assert admission.num_waiting == 2
    admission.admit(num_sequences=2).release()
    ticket.release()  # sequences 0 and 2 never started: their places are freed too
    assert (admission.num_waiting, admission.num_in_flight) == (0, 0)


def test_a_request_that_could_never_fit_gets_400() -> None:
    admission = Admission(max_waiting=4)
    with pytest.raises(ApiError) as refused:
        admission.admit(num_sequences=5)
    err = refused.value
    assert (err.status, err.code, err.headers) == (400, "too_many_sequences", {})
    assert err.message == (
        "the request fans out to 5 sequences (prompts x n); this server admits at most 4 at once"
    )
    assert (admission.num_waiting, admission.num_in_flight) == (0, 0)


def test_draining_refuses_new_requests_and_lets_old_ones_finish() -> None:
    admission = Admission(max_waiting=4)
    ticket = admission.admit()
    admission.start_draining()
    with pytest.raises(ApiError) as refused:
        admission.admit()
    err = refused.value
    assert (err.status, err.code, err.message) == (
        503,
        "shutting_down",
        "the server is shutting down",
    )
    assert "Retry-After" not in err.headers
    assert not admission.idle
    ticket.release()
    assert admission.idle
    assert admission.num_in_flight == 0
