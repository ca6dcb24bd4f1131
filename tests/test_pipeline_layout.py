"""Pipeline layouts (uneven stages, megatron layout strings, virtual stages, MTP on the last stage), the one-line
refusals of layouts that do not divide, and the same layout flags in the HF -> mcore converter."""


import pytest



def _cfg(num_layers=5, mtp=False, indexer_types=None, **kw):
    from megatron_glm5.config import Glm5Config, tiny_hf_config

    hf = tiny_hf_config(num_layers=num_layers, mtp=mtp, with_vision=False)
    if indexer_types is not None:
        hf["text_config"]["indexer_types"] = indexer_types
    return Glm5Config.from_hf(hf, **kw)


def _ranges(cfg):
    from megatron_glm5.config.parallelism import stage_layer_ranges

    return {k: (r.start, r.stop) for k, r in stage_layer_ranges(cfg).items()}


def test_balanced_layout():
    from megatron_glm5.config.parallelism import balanced_pipeline_layout

    assert balanced_pipeline_layout(5, 2) == "Et*3|t*2L"
    assert balanced_pipeline_layout(45, 2, mtp=True) == "Et*23|t*22mL"
    assert balanced_pipeline_layout(45, 4) == "Et*11|t*12|t*11|t*11L"  # extra layers on middle stages first
    assert balanced_pipeline_layout(7, 2, 2) == "Et*2|t*2|t*2|tL"


@pytest.mark.parametrize("kw,want", [
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*3|t*2L"), {(0, 0): (0, 3), (1, 0): (3, 5)}),
    (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2), {(0, 0): (0, 2), (1, 0): (2, 5)}),
    (dict(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=1), {(0, 0): (0, 4), (1, 0): (4, 5)}),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t|tt|tL"),
     {(0, 0): (0, 1), (1, 0): (1, 2), (0, 1): (2, 4), (1, 1): (4, 5)}),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|ttttt|L|"),  # empty stages allowed
     {(0, 0): (0, 0), (1, 0): (0, 5), (0, 1): (5, 5), (1, 1): (5, 5)}),
])
def test_stage_ranges(kw, want):
    cfg = _cfg(**kw)
    assert _ranges(cfg) == want
    assert cfg.variable_seq_lengths  # the [s, b, n*h] streams are not megatron's default p2p shape


def test_layers_per_virtual_stage():
    cfg = _cfg(4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    assert cfg.virtual_pipeline_model_parallel_size == 2
    assert _ranges(cfg) == {(0, 0): (0, 1), (1, 0): (1, 2), (0, 1): (2, 3), (1, 1): (3, 4)}
    assert cfg.batch_p2p_comm is False  # two stages + virtual stages: activation and gradient to the same peer


def test_even_vpp_and_mtp_stage():
    from megatron_glm5.config.parallelism import mtp_on_stage

    cfg = _cfg(4, mtp=True, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert _ranges(cfg) == {(0, 0): (0, 1), (1, 0): (1, 2), (0, 1): (2, 3), (1, 1): (3, 4)}
    assert [mtp_on_stage(cfg, r, v) for r in (0, 1) for v in (0, 1)] == [False, False, False, True]
    cfg = _cfg(5, mtp=True, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|tttmL")
    assert _ranges(cfg) == {(0, 0): (0, 2), (1, 0): (2, 5)}


@pytest.mark.parametrize("kw,needle", [
    (dict(tensor_model_parallel_size=3), "tensor_model_parallel_size: 3 does not divide num_attention_heads"),
    (dict(expert_model_parallel_size=3), "expert_model_parallel_size: 3 does not divide num_moe_experts = 8"),
    (dict(expert_tensor_parallel_size=3), "expert_tensor_parallel_size: 3 does not divide moe_ffn_hidden_size"),
    (dict(pipeline_model_parallel_size=6), "6 pipeline stages (pp 6 x vpp 1) for 5 decoder layers: each stage needs"),
    (dict(pipeline_model_parallel_size=2), "set pipeline_model_parallel_layout (e.g. 'Et*3|t*2L')"),
    (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=5), "0 decoder layers left"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|tttL"), "holds 6 decoder layers"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|ttX"), "Invalid layer character"),
    (dict(mtp=True, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Etttm|ttL"),
     "the MTP layer ('m') must sit on the last stage"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|ttmL"), "holds 1 MTP layers"),
    (dict(indexer_types=["full", "full", "full", "shared", "full"], pipeline_model_parallel_size=2,
          num_layers_in_first_pipeline_stage=2), "shared-indexer DSA layer 3 would sit on pipeline stage 1"),
    (dict(sequence_parallel=True), "sequence_parallel: needs tensor_model_parallel_size > 1"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2),
     "num_layers_per_virtual_pipeline_stage: 2 layers per virtual stage do not divide 5 decoder layers"),
])
def test_refusals_are_one_line(kw, needle):
    from megatron_glm5.config import Glm5ConfigError

    with pytest.raises(Glm5ConfigError) as e:
        _cfg(**kw)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_shared_indexer_kept_with_its_full_layer():
    cfg = _cfg(indexer_types=["full", "full", "full", "shared", "full"], pipeline_model_parallel_size=2,
               num_layers_in_first_pipeline_stage=1)  # DSA layers 1 (full) and 3 (shared) both on stage 1
    assert _ranges(cfg) == {(0, 0): (0, 1), (1, 0): (1, 5)}


def test_training_needs_sequence_parallel_for_moe_with_tp():
    from megatron_glm5.config import Glm5ConfigError
    from megatron_glm5.config.parallelism import check_parallel_layout

    cfg = _cfg(tensor_model_parallel_size=2)
    check_parallel_layout(cfg)  # building (e.g. for a checkpoint) is fine
    with pytest.raises(Glm5ConfigError, match="need sequence parallelism"):
        check_parallel_layout(cfg, for_training=True)


# ----------------------------------------------------------------------------------------------- converter
def test_converter_validates_the_layout_flags():
    from megatron_glm5.checkpoint.conversion_target import LayoutError as ConversionInputError, validate_layout
    from megatron_glm5.config import glm5_flash_hf_config, tiny_hf_config

    released = glm5_flash_hf_config()  # 45 decoder layers + 1 MTP layer
    validate_layout(released, pp=2, pipeline_layout="Et*23|t*22mL")
    validate_layout(released, pp=4, pipeline_layout="Et*11|t*12|t*11|t*11mL")
    validate_layout(released, pp=2, first_stage_layers=22)
    validate_layout(released, pp=8, pipeline_layout="Et*5|(t*6|)*6t*4mL")
    with pytest.raises(ConversionInputError, match="do not divide 45 decoder layers; set pipeline_model_parallel_"
                                                   "layout \\(e.g. 'Et\\*23\\|t\\*22mL'\\)"):
        validate_layout(released, pp=2)
    tiny = tiny_hf_config(num_layers=5, mtp=True)
    validate_layout(tiny, pp=2, pipeline_layout="Ettt|ttmL")
    with pytest.raises(ConversionInputError, match="the MTP layer"):
        validate_layout(tiny, pp=2, pipeline_layout="Etttm|ttL")
    with pytest.raises(ConversionInputError, match="holds 4 decoder layers"):
        validate_layout(tiny, pp=2, pipeline_layout="Ett|ttmL")


@pytest.fixture(scope="module")
def tiny_ckpt_5(tmp_path_factory):
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    from megatron_glm5.config import tiny_hf_config

    return write_checkpoint(str(tmp_path_factory.mktemp("pp5") / "hf"), tiny_hf_config(num_layers=5),
                            fmt="bf16", mtp=True, seed=4)


@pytest.mark.parametrize("flags,layout", [
    (["--pp", "2", "--pipeline-model-parallel-layout", "Ett|tttmL"], {"pp": 2, "pipeline_layout": "Ett|tttmL"}),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "2"], {"pp": 2, "first_stage_layers": 2}),
])
def test_convert_cli_pp2_on_5_plus_1_layers(tiny_ckpt_5, tmp_path, flags, layout, mcore):
    import json

    from megatron_glm5.cli import convert_hf_to_mcore

    out = tmp_path / "out"
    assert convert_hf_to_mcore.main(["--hf-dir", tiny_ckpt_5, "--out", str(out), "--no-progress", *flags]) == 0
    info = json.load(open(out / "release" / "conversion_info.json"))
    assert info["layout"] == {"tp": 1, "ep": 1, **layout}


def test_convert_cli_refuses_a_bad_layout_in_one_line(tiny_ckpt_5, tmp_path, capsys, mcore):
    from megatron_glm5.cli import convert_hf_to_mcore

    out = tmp_path / "out"
    for flags, needle in ((["--pipeline-model-parallel-layout", "Etttm|ttL"], "the MTP layer ('m') must sit on the last"),
                          ([], "2 (virtual) pipeline stages do not divide 5 decoder layers")):
        assert convert_hf_to_mcore.main(["--hf-dir", tiny_ckpt_5, "--out", str(out), "--pp", "2", *flags]) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and needle in err[0], err
        assert not out.exists()


def test_initialize_and_builder_refuse_layouts_in_one_line(mcore):
    from megatron_glm5.initialize import initialize_megatron
    from megatron_glm5.models.builder import build_model_chunks

    for kw, needle in ((dict(tp=3), "world size 1 is not divisible by tp*pp*cp = 3"),
                       (dict(ep=2), "world size 1 is not divisible by etp*ep*pp = 2"),
                       (dict(vpp=2), "vpp 2 needs pp > 1")):
        with pytest.raises(ValueError) as e:
            initialize_megatron(**kw)
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="the config and megatron's parallel state disagree: "
                                         "pipeline_model_parallel_size 2 vs 1"):
        build_model_chunks(_cfg(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3))
