"""ProbeSettings: the probe options of a check as one object, validated once; check_gradients and
check_applied_gradient take them one by one (``**options``) or whole (settings=), not both."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from gradwatch import ProbeSettings, check_applied_gradient, check_gradients
from gradwatch.engine.settings import ProbeOptions


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _model_and_batch() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2), (torch.randn(6, 4), torch.randn(6, 2))


def test_the_typed_options_are_the_fields_of_the_settings() -> None:
    # ``**options: Unpack[ProbeOptions]`` types what the dataclass defaults and documents: the same names
    assert ProbeOptions.__optional_keys__ == set(ProbeSettings.option_names())


def test_settings_whole_check_as_the_same_options_one_by_one() -> None:
    model, batch = _model_and_batch()
    options = {"param_probes": 3, "precision": "native", "ignore": ["bias"], "seed": 4}
    one_by_one = check_gradients(model, batch, _loss, step=2, **options)
    whole = check_gradients(model, batch, _loss, step=2, settings=ProbeSettings(**options))
    assert [(p.kind, p.target, p.index) for p in whole.probes] == [
        (p.kind, p.target, p.index) for p in one_by_one.probes
    ]
    assert whole.verdict == one_by_one.verdict == "ok"


def test_settings_and_options_one_by_one_are_refused_together() -> None:
    model, batch = _model_and_batch()
    with pytest.raises(
        ValueError, match=r"either one by one or as `settings`, not both; got `settings` and \['seed'\]"
    ):
        check_gradients(model, batch, _loss, seed=3, settings=ProbeSettings())
    with pytest.raises(TypeError, match="`settings` must be None or a ProbeSettings; got dict"):
        check_gradients(model, batch, _loss, settings={"seed": 3})  # type: ignore[arg-type]


def _applied_window() -> tuple[torch.nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    batches = [(torch.randn(6, 4), torch.randn(6, 4)) for _ in range(2)]
    for batch in batches:
        (_loss(model, batch) / 2).backward()
    return model, batches


def test_the_applied_check_takes_settings_whole_as_the_same_options_one_by_one() -> None:
    model, batches = _applied_window()
    options = {"tensor_probes": 2, "ignore": ["0.*"], "seed": 3}
    one_by_one = check_applied_gradient(model, batches, _loss, rotation=1, **options)  # type: ignore[arg-type]
    whole = check_applied_gradient(model, batches, _loss, rotation=1, settings=ProbeSettings(**options))
    probed = [(p.kind, p.target) for p in whole.probes]
    assert probed == [(p.kind, p.target) for p in one_by_one.probes]
    assert not [target for _, target in probed if target.startswith("0.")]  # ignore= reached the check
    assert whole.verdict == one_by_one.verdict == "ok"
    with pytest.raises(ValueError, match=r"not both; got `settings` and \['tensor_probes'\]"):
        check_applied_gradient(model, batches, _loss, tensor_probes=1, settings=ProbeSettings())
    with pytest.raises(ValueError, match="`tensor_probes` must be an integer >= 0; got None"):
        check_applied_gradient(model, batches, _loss, tensor_probes=None)  # type: ignore[arg-type]


def test_settings_are_frozen_and_replace_validates_again() -> None:
    settings = ProbeSettings(ignore=["a.*"])  # type: ignore[arg-type]
    assert settings.ignore == ("a.*",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="`param_probes` must be an integer >= 0; got -1"):
        dataclasses.replace(settings, param_probes=-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_probes": -1}, "`tensor_probes` must be an integer >= 0; got -1"),
        ({"random_probes": 1.5}, "`random_probes` must be an integer >= 0; got 1.5"),
        ({"input_probes": None}, "`input_probes` must be an integer >= 0; got None"),
        ({"probe_batch_size": 0}, "`probe_batch_size` must be None or an integer >= 1; got 0"),
        ({"precision": "half"}, "`precision` must be one of 'auto', 'native', 'float64'; got 'half'"),
        ({"ignore": "bias"}, "`ignore` must be a list or tuple of pattern strings"),
        ({"rtol": 2.0}, "`rtol` must be None or a number strictly between 0 and 1; got 2.0"),
        ({"seed": -1}, "`seed` must be an integer >= 0; got -1"),
        ({"float64_reductions": 1}, "`float64_reductions` must be True or False; got 1"),
        ({"vectorize": None}, "`vectorize` must be True or False; got None"),
        ({"fail_on_imprecise": "no"}, "`fail_on_imprecise` must be True or False; got 'no'"),
    ],
    ids=[
        "tensor_probes",
        "random_probes",
        "input_probes",
        "probe_batch_size",
        "precision",
        "ignore",
        "rtol",
        "seed",
        "float64_reductions",
        "vectorize",
        "fail_on_imprecise",
    ],
)
def test_every_field_is_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProbeSettings(**kwargs)
