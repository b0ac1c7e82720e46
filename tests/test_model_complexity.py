"""Model complexity: parameters and FLOPs/MACs against hand-computed values."""

from __future__ import annotations

import pytest

from zeus_async.errors import ConfigError
from zeus_async.model_complexity import model_complexity

torch = pytest.importorskip("torch")


def small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),  # 8*3*3*3 + 8 = 224 parameters
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 10),  # 288*10 + 10 = 2890 parameters
    )


def test_counts_match_hand_computed_values() -> None:
    model = small_cnn()
    model[0].weight.requires_grad_(False)
    model.train()
    result = model_complexity(model, (2, 3, 8, 8))
    assert result.params == 224 + 2890
    assert result.trainable_params == 224 + 2890 - 216
    # conv: 2 samples * 8 channels * 6*6 outputs * 27 MACs; linear: 2 * 288 * 10 MACs
    conv_macs, linear_macs = 2 * 8 * 36 * 27, 2 * 288 * 10
    assert result.macs == conv_macs + linear_macs
    assert result.flops == 2 * result.macs
    assert result.flops_by_operator == {
        "aten.convolution": 2 * conv_macs,
        "aten.addmm": 2 * linear_macs,
    }
    assert model.training  # mode restored
    assert result.as_meta() == {
        "model.params": "3114",
        "model.trainable_params": "2898",
        "model.flops": str(result.flops),
        "model.macs": str(result.macs),
        "model.input_size": "2x3x8x8",
    }


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"torch\.nn\.Module"):
        model_complexity(object(), (1, 3))
    with pytest.raises(ConfigError, match="input_size"):
        model_complexity(small_cnn(), (1, 0, 8))
