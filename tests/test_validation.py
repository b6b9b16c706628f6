"""lgc.validation: the aliases' bounds and types, check's message and identity, spell and fits_json."""

import math
import typing
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from lgc.validation import (
    Density,
    Fraction,
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    OpenFraction,
    PositiveFloat,
    PositiveFraction,
    PositiveInt,
    Seed,
    check,
    fits_json,
    spell,
)

#: alias -> (values it accepts, values it refuses); the edges of each range on both sides.
CASES = {
    "Density": (Density, [1, 1.0, 1e-9, 0.5], [0, 0.0, -0.1, 1.0000001, math.nan, math.inf, True, "0.1", None]),
    "Fraction": (Fraction, [0, 0.0, 1, 1.0, 0.5], [-1e-9, 1.0000001, math.nan, False, True, "0.5", None]),
    "PositiveFraction": (PositiveFraction, [1, 1.0, 1e-9], [0, 0.0, -1, 1.0000001, math.nan, True, "1", None]),
    "OpenFraction": (OpenFraction, [1e-9, 0.5, 0.999999], [0, 0.0, 1, 1.0, math.nan, True, "0.5", None]),
    "Momentum": (Momentum, [0, 0.0, 0.9, 0.999999], [1, 1.0, -1e-9, math.nan, math.inf, False, "0.9", None]),
    "PositiveInt": (PositiveInt, [1, 2**40], [0, -1, 1.0, 2.5, True, "1", None]),
    "NonNegativeInt": (NonNegativeInt, [0, 1, 2**40], [-1, 0.0, False, True, "0", None]),
    "PositiveFloat": (PositiveFloat, [1, 1e-300, 1.5, 1e300], [0, 0.0, -1, math.inf, math.nan, True, "1.5", None]),
    "NonNegativeFloat": (NonNegativeFloat, [0, 0.0, 2, 1e-8], [-1e-9, math.inf, math.nan, False, "0", None]),
    "Seed": (Seed, [0, 2**63 - 1], [-1, 2**63, 1.0, True, False, "0", None]),
}


@pytest.mark.parametrize(
    ("alias", "value"), [(alias, value) for alias, (_, good, _) in CASES.items() for value in good], ids=repr
)
def test_every_alias_accepts_its_edges(alias, value):
    assert check("knob", value, CASES[alias][0]) is value


@pytest.mark.parametrize(
    ("alias", "value"), [(alias, value) for alias, (_, _, bad) in CASES.items() for value in bad], ids=repr
)
def test_every_alias_refuses_bools_strings_and_what_lies_outside(alias, value):
    annotation = CASES[alias][0]
    with pytest.raises(ValueError) as err:
        check("knob", value, annotation)
    assert str(err.value) == f"knob must be {spell(annotation)}, got {value!r}"


def test_check_names_the_knob_what_it_must_be_and_the_value():
    with pytest.raises(ValueError, match=r"^density must be a number in \(0, 1\], got 1.5$"):
        check("density", 1.5, Density)
    with pytest.raises(ValueError, match=r"^levels must be a positive integer, got True$"):
        check("levels", True, PositiveInt)
    with pytest.raises(ValueError, match=r"^bucket_size must be a positive integer or None, got '64'$"):
        check("bucket_size", "64", PositiveInt | None)


@pytest.mark.parametrize(
    ("value", "annotation"),
    [(0.25, Density), (1, Density), (7, PositiveInt), (None, PositiveInt | None), (np.float64(0.5), Fraction)],
    ids=repr,
)
def test_check_returns_the_very_object_it_was_given(value, annotation):
    assert check("knob", value, annotation) is value


def test_a_numpy_scalar_that_is_not_a_python_number_is_refused_with_how_to_pass_it():
    # np.float64 is a float; np.int64 and np.float32 are not Python numbers and would reach records as numpy's.
    with pytest.raises(
        ValueError,
        match=r"^min_numel must be a positive integer, got np.int64\(1024\) \(a numpy "
        r"scalar: pass int\(x\), 1024\)$",
    ):
        check("min_numel", np.int64(1024), PositiveInt)
    with pytest.raises(ValueError, match=r"got np.float32\(0.5\) \(a numpy scalar: pass float\(x\), 0.5\)$"):
        check("density", np.float32(0.5), Density)
    with pytest.raises(ValueError, match=r"got np.True_ \(a numpy scalar: pass bool\(x\), True\)$"):
        check("lr", np.bool_(True), PositiveFloat)  # a bool is not a number
    assert check("density", np.float64(0.5), Density) == 0.5  # a float
    with pytest.raises(ValueError, match=r"^density must be a number in \(0, 1\], got 1.5$"):
        check("density", 1.5, Density)  # no hint for a Python value


def test_an_int_is_a_float_but_a_float_is_not_an_int():
    assert check("x", 3, PositiveFloat) == 3 and type(check("x", 3, PositiveFloat)) is int
    with pytest.raises(ValueError, match="x must be a positive integer, got 3.0"):
        check("x", 3.0, PositiveInt)


def test_spell_says_what_an_annotation_asks_for():
    assert spell(Density) == "a number in (0, 1]"
    assert spell(Density | None) == "a number in (0, 1] or None"
    assert spell(typing.Optional[PositiveInt]) == "a positive integer or None"  # noqa: UP045 (the typing spelling too)
    assert spell(int) == "an int"
    assert spell(None) == "None"
    assert spell(int | str) == "an int or a str"
    assert spell(Literal["a", "b"]) == "one of 'a', 'b'"
    assert spell(Literal["a"] | int | Literal["b"]) == "one of 'a', 'b' or an int"
    assert spell(list[float] | None) == "a list of float or None"
    assert spell(tuple[int, float]) == "a list [int, float]"
    assert spell(dict[str, int | None]) == "a dict of str to (int or None)"
    # A member named twice is said once.
    assert spell(typing.Annotated[int, "meta"] | int) == "an int"


@pytest.mark.parametrize(
    ("value", "annotation"),
    [
        ([1, 2], tuple[int, int]),
        ([1, 2, 3], tuple[int, ...]),
        ("runs/x", Path),
        (0.5, Density),
        (1, Density),
        (None, PositiveInt | None),
        (3, PositiveInt | None),
        ({"a": 1}, dict[str, int]),
    ],
    ids=repr,
)
def test_fits_json_accepts_what_yaml_writes_for_the_annotation(value, annotation):
    assert fits_json(value, annotation)


@pytest.mark.parametrize(
    ("value", "annotation"),
    [
        (1.5, int),
        (1.5, PositiveInt),
        (True, int),
        ("1", int),
        ("0.5", Density),
        (0, Density),
        ([1, 2, 3], tuple[int, int]),
        (3, Path),
        (0, PositiveInt | None),
    ],
    ids=repr,
)
def test_fits_json_refuses_a_value_of_the_wrong_type_or_range(value, annotation):
    assert not fits_json(value, annotation)


def test_fits_json_accepts_anything_for_an_annotation_it_cannot_check():
    assert fits_json("anything", "NotAType")  # a forward reference pydantic cannot resolve


def _knobs():
    from lgc.analysis.recorder import GradientRecorder
    from lgc.compressors import (
        ChunkedTopKCompressor,
        DGCCompressor,
        ErrorFeedback,
        FP4Compressor,
        QSGDCompressor,
        QuantizedValues,
        RandomBlockCompressor,
        RedSyncCompressor,
        SBCCompressor,
        TernGradCompressor,
        TopKCompressor,
    )
    from lgc.compressors.qsgd import Levels
    from lgc.ddp.local_sgd import CommunicationDelayState
    from lgc.ddp.powersgd import PowerSGDHookState
    from lgc.learned.rar import LGCRingAllreduceState
    from lgc.learned.shared_index import ScaleChunk, SharedIndexState
    from lgc.learned.state import LGCHookState
    from lgc.lit.classification import LinearWarmup
    from lgc.lit.data import DigitsDataModule

    return [
        (TopKCompressor, "density", Density),
        (RandomBlockCompressor, "seed", Seed | None),
        (DGCCompressor, "momentum", Momentum),
        (DGCCompressor, "weight_decay", NonNegativeFloat),
        (ErrorFeedback, "decay", PositiveFraction),
        (FP4Compressor, "bucket_size", PositiveInt | None),
        (QSGDCompressor, "levels", Levels),
        (TernGradCompressor, "clip_sigma", PositiveFloat | None),
        (QuantizedValues, "range_sigmas", PositiveFloat),
        (SBCCompressor, "density", Density),
        (ChunkedTopKCompressor, "k", PositiveInt),
        (RedSyncCompressor, "epsilon", OpenFraction),
        (CommunicationDelayState, "outer_momentum", Momentum | None),
        (PowerSGDHookState, "matrix_approximation_rank", PositiveInt),
        (LGCHookState, "density", Density),
        (LGCRingAllreduceState, "seed", Seed),
        (SharedIndexState, "chunk", ScaleChunk),
        (LinearWarmup, "start_factor", PositiveFraction),
        (DigitsDataModule, "val_fraction", OpenFraction),
        (GradientRecorder, "every_n_steps", PositiveInt),
    ]


def test_constructors_annotate_their_knobs_with_aliases_that_resolve_at_runtime():
    """``typing.get_type_hints`` (what the config check reads) finds every alias in its module's globals."""
    for cls, name, alias in _knobs():
        assert typing.get_type_hints(cls.__init__, include_extras=True)[name] == alias, (cls.__name__, name)
