"""The meter's reading of a replica's work counters from its metrics exposition."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from octacloud.control.usage import COUNT_METRIC, EXEC_METRIC, parse_work

EXPOSITION = f"""# HELP {EXEC_METRIC} Cumulative compute inference duration in microseconds.
# TYPE {EXEC_METRIC} gauge
{EXEC_METRIC}{{model="mlp",version="1"}} 1500.0
{EXEC_METRIC}{{model="odd }} name",version="2"}} 250 1700000000000
# TYPE {COUNT_METRIC} gauge
{COUNT_METRIC}{{model="mlp",version="1"}} 12.0
{COUNT_METRIC}{{model="odd }} name",version="2"}} 3
{COUNT_METRIC}_other{{model="mlp"}} 1000
nv_inference_request_success{{model="mlp",version="1"}} 99
{COUNT_METRIC} 5
"""


def full_parse(text: str) -> tuple[int, int]:
    """The same sums through prometheus_client's parser, which reads every family."""
    exec_us = inferences = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == EXEC_METRIC:
                exec_us += int(sample.value)
            elif sample.name == COUNT_METRIC:
                inferences += int(sample.value)
    return exec_us, inferences


def test_only_the_two_families_are_summed_as_the_full_parser_sums_them() -> None:
    assert parse_work(EXPOSITION) == full_parse(EXPOSITION) == (1750, 20)
    assert parse_work("") == (0, 0)


@pytest.mark.parametrize(
    "line",
    [f'{COUNT_METRIC}{{model="m"}} many', f'{EXEC_METRIC}{{model="m"}}', f"{COUNT_METRIC} +Inf", f"{EXEC_METRIC} NaN"],
)
def test_a_sample_of_theirs_that_is_no_number_is_named(line: str) -> None:
    with pytest.raises(ValueError, match="unreadable"):
        parse_work(f"# TYPE x gauge\n{line}\n")
