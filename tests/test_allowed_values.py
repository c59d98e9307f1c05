"Every module that dispatches on a name accepts exactly the names its config field's `Literal` allows."

from typing import get_args

import pytest

import cipher_nb.config.load as config
import cipher_nb.data.sources as data
import cipher_nb.model.boundary as boundary
import cipher_nb.model.lm as model
import cipher_nb.model.moe as moe
import cipher_nb.optim.optimizers as optim
import cipher_nb.optim.precision as precision
import cipher_nb.persist.stages as stages


def names(literal) -> tuple:
    return get_args(literal)


# (module tuple, the config Literal it must agree with); the module attribute is read at test time
PAIRS = [
    ("moe.MOE_IMPLS", lambda: moe.MOE_IMPLS, config.MoEKernel),
    ("model.ATTN_KERNELS", lambda: model.ATTN_KERNELS, config.AttnKernel),
    ("boundary.BP_MODES", lambda: boundary.BP_MODES, config.BPMode),
    ("boundary.CAUSAL_BP_MODES", lambda: boundary.CAUSAL_BP_MODES, config.CausalBPMode),
    ("precision.PRECISIONS", lambda: precision.PRECISIONS, config.Precision),
    ("precision.FP8_RECIPES", lambda: precision.FP8_RECIPES, config.FP8Recipe),
    ("optim.OPTIMIZERS", lambda: optim.OPTIMIZERS, config.OptimName),
    ("stages.STAGES", lambda: stages.STAGES, config.Stage),
    ("data source kinds", lambda: data.SOURCE_KINDS, config.Source),
]


@pytest.mark.parametrize("name,get,literal", PAIRS, ids=[p[0] for p in PAIRS])
def test_module_tuple_matches_config_literal(name, get, literal):
    assert tuple(get()) == names(literal), f"{name} = {tuple(get())} but the config allows {names(literal)}"


def test_config_fields_use_the_literals():
    "The fields are typed with the Literals the modules are checked against (so validation reads the same names)."
    from typing import get_type_hints

    want = {
        (config.MoEConfig, "impl"): config.MoEImpl,
        (config.AttentionConfig, "impl"): config.AttnImpl,
        (config.TrainConfig, "activation_checkpoint"): config.ActCheckpoint,
        (config.MoEConfig, "router_score"): config.RouterScore,
        (config.MoEConfig, "bias_rule"): config.BiasRule,
        (config.BoundaryConfig, "mode"): config.BPMode,
        (config.BoundaryConfig, "loss"): config.BPLoss,
        (config.DataConfig, "source"): config.Source,
        (config.DataConfig, "codec"): config.Codec,
        (config.TrainConfig, "precision"): config.Precision,
        (config.TrainConfig, "fp8_recipe"): config.FP8Recipe,
        (config.TrainConfig, "parallel"): config.Parallel,
        (config.OptimConfig, "name"): config.OptimName,
        (config.StageConfig, "name"): config.Stage,
        (config.StageConfig, "source_stage"): config.SourceStage,
        (config.SFTConfig, "mask"): config.SFTMask,
    }
    for (cls, f), lit in want.items():
        assert get_type_hints(cls)[f] == lit, f"{cls.__name__}.{f}"


def test_moe_impl_is_auto_plus_the_kernels():
    assert names(config.MoEImpl) == ("auto", *moe.MOE_IMPLS)


def test_attention_impl_is_auto_plus_the_kernels():
    assert names(config.AttnImpl) == ("auto", *model.ATTN_KERNELS)


def test_low_precision_chain_is_allowed():
    assert set(precision.LOW_PRECISION) <= set(names(config.Precision))


def test_source_stage_is_empty_or_a_stage():
    assert names(config.SourceStage) == ("", *stages.STAGES)
    assert set(stages.STAGE_SOURCES) == set(stages.STAGES)
    assert {s for v in stages.STAGE_SOURCES.values() for s in v} <= set(stages.STAGES)
