import pytest

import sbpjax as sj
from sbpjax.sbp import normalize_nd_sbp


def test_values_and_long_names():
    assert sj.S(0) == sj.split(0) == sj.Split(0)
    assert sj.B is sj.broadcast
    assert sj.P == sj.partial_sum == sj.Partial("sum")
    assert sj.P_max == sj.partial_max == sj.Partial("max")
    assert sj.P_min == sj.partial_min == sj.Partial("min")
    assert sj.S(1) != sj.S(0) and sj.P != sj.P_max
    assert {sj.S(0), sj.S(0), sj.B} == {sj.S(0), sj.B}  # hashable


@pytest.mark.parametrize(
    "value, text",
    [
        (sj.S(0), "S(0)"),
        (sj.S(3), "S(3)"),
        (sj.B, "B"),
        (sj.P, "P"),
        (sj.P_max, "P(max)"),
        (sj.P_min, "P(min)"),
    ],
)
def test_print_round_trips(value, text):
    assert str(value) == repr(value) == text
    assert sj.parse_sbp(text) == (value,)


def test_parse_nd():
    assert sj.parse_sbp("S(0), P(max)") == (sj.S(0), sj.P_max)
    assert sj.parse_sbp("(S(1),B,P)") == (sj.S(1), sj.B, sj.P)
    assert sj.parse_sbp(" split(2) , broadcast, partial_min, P(sum)") == (sj.S(2), sj.B, sj.P_min, sj.P)
    nd = (sj.S(0), sj.B, sj.P_max)
    assert sj.parse_sbp(sj.format_sbp(nd)) == nd
    assert sj.parse_sbp(str(nd)) == nd  # str() of a tuple of SBPs round-trips too


@pytest.mark.parametrize("bad", ["Q", "S()", "S(x)", "P(mean)", "", "S(0),,B", "S(-1)"])
def test_parse_errors(bad):
    with pytest.raises(sj.SBPError) as e:
        sj.parse_sbp(bad)
    assert "S(" in str(e.value) or "split dim" in str(e.value) or "partial op" in str(e.value)


def test_constructor_errors():
    with pytest.raises(sj.SBPError, match="non-negative"):
        sj.S(-1)
    with pytest.raises(sj.SBPError, match="unknown partial op"):
        sj.Partial("mean")
    assert issubclass(sj.SBPError, ValueError)


def test_validation_against_rank_and_placement():
    assert normalize_nd_sbp(sj.S(0), 1, 2) == (sj.S(0),)
    assert normalize_nd_sbp("S(0), B", 2, 2) == (sj.S(0), sj.B)
    with pytest.raises(sj.SBPError, match=r"has 1 entries but the placement has 2 axes"):
        normalize_nd_sbp((sj.S(0),), 2, 2)
    with pytest.raises(sj.SBPError, match=r"splits dim 2, but the tensor has 2 dims"):
        normalize_nd_sbp((sj.S(2), sj.B), 2, 2)
    with pytest.raises(sj.SBPError, match="0-d tensor"):
        normalize_nd_sbp((sj.S(0),), 1, 0)
