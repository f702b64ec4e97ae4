"""The job spec of a vision-language job: columns, the webdataset format, [job] image_token_id, the vlm
cost's alpha_v / beta_v, how the job's image_token_id reaches the vlm transform, and which jobs have image keys."""

from __future__ import annotations

import tomllib

import pytest

import msdata_client as msd
from msdata_client.errors import ConfigError
from msdata_client.spec import BalanceSpec, JobSpec, SourceSpec
from msdata_server.job.images import ImageKeys, image_keys, source_transform
from msdata_server.planner.spec import planner_config
from msdata_server.transforms import IMAGE_TOKEN, load_transform

VLM = "msdata_server.transforms:vlm(patch=14, merge=2)"


def job(tmp_path, *, transform=VLM, columns=("image", "caption"), fmt="parquet", **kw):
    g = msd.DGraph("pics", seed=1).source("p", fmt, [str(tmp_path)], columns=columns, transform=transform)
    g.mix({"p": 1.0}).pack(1024, image_token_id=kw.pop("image_token_id", IMAGE_TOKEN))
    if kw:
        g.cost("vlm", **kw)
    return g.plan()


def test_round_trip_through_toml_and_the_data_identity(tmp_path):
    spec = job(tmp_path, fmt="webdataset", columns=("jpg;png", "txt"), alpha_v=2.0, beta_v=100.0, image_token_id=300)
    back = JobSpec.from_dict(tomllib.loads(spec.to_toml()))
    assert back == spec
    assert back.digest() == spec.digest()
    assert back.sources[0].columns == ("jpg;png", "txt")
    assert back.sources[0].format == "webdataset"
    assert back.image_token_id == 300
    assert (back.balance.alpha_v, back.balance.beta_v) == (2.0, 100.0)
    cfg = planner_config(back)
    assert cfg.cost == "vlm"
    assert (cfg.alpha_v, cfg.beta_v) == (2.0, 100.0)
    # each of them is part of the data identity: a state of one does not restore into another
    others = [
        job(tmp_path, fmt="webdataset", columns=("jpg;png", "txt"), alpha_v=2.0, beta_v=100.0, image_token_id=301),
        job(tmp_path, fmt="webdataset", columns=("jpg;png", "txt"), alpha_v=2.5, beta_v=100.0, image_token_id=300),
        job(tmp_path, fmt="webdataset", columns=("jpg", "txt"), alpha_v=2.0, beta_v=100.0, image_token_id=300),
    ]
    assert len({spec.data_digest(), *(o.data_digest() for o in others)}) == 4


def test_text_jobs_keep_their_digests(tmp_path):
    """A job that sets none of the new keys writes none of them (checkpoints of existing jobs still fit)."""
    spec = msd.DGraph("t").source("a", "parquet", [str(tmp_path)]).mix({"a": 1.0}).plan()
    d = spec.to_dict()
    assert "image_token_id" not in d["job"]
    assert "columns" not in d["source"][0]
    assert set(d["balance"]) == {"cost", "alpha", "beta", "method"}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: SourceSpec(name="s", format="parquet", paths=(p,), columns=()), "non-empty list of distinct"),
        (lambda p: SourceSpec(name="s", format="parquet", paths=(p,), columns=("a", "a")), "distinct"),
        (lambda p: SourceSpec(name="s", format="parquet", paths=(p,), columns=("a", 3)), "non-empty strings"),
        (
            lambda p: SourceSpec(name="s", format="parquet", paths=(p,), column="img", columns=("a", "b")),
            "sets both column='img' and columns",
        ),
        (lambda p: SourceSpec(name="s", format="synthetic", columns=("a",)), "synthetic and has no columns"),
        (lambda p: SourceSpec(name="s", format="tar", paths=(p,)), "'webdataset'"),
        (lambda p: SourceSpec(name="s", format="parquet", paths=(p,), transform="vlm(patch=14)"), "module:factory"),
        (lambda p: BalanceSpec(cost="attention", alpha_v=2.0), 'apply only to cost = "vlm"'),
        (lambda p: BalanceSpec(cost="vlm", beta_v=-1.0), "balance beta_v"),
        (lambda p: BalanceSpec(cost="vlm", alpha_v=float("nan")), "balance alpha_v"),
        (lambda p: job(p, image_token_id=257), "image_token_id=257 equals pad_id"),
        (lambda p: job(p, image_token_id=-1), "job image_token_id"),
    ],
)
def test_bad_settings_are_named(tmp_path, make, message):
    with pytest.raises(ConfigError, match=message):
        make(str(tmp_path))


def test_the_jobs_image_token_id_reaches_the_vlm_transform(tmp_path):
    plain = job(tmp_path)
    assert source_transform(plain, plain.sources[0]) == VLM[:-1] + ", seq_len=1024)"  # the job's seq_len, always
    other = job(tmp_path, image_token_id=300)
    name = source_transform(other, other.sources[0])
    assert name == "msdata_server.transforms:vlm(patch=14, merge=2, image_token_id=300, seq_len=1024)"
    assert load_transform(name).__name__ == "transform"  # it builds
    bare = job(tmp_path, transform="msdata_server.transforms:vlm", image_token_id=301)
    assert source_transform(bare, bare.sources[0]) == "msdata_server.transforms:vlm(image_token_id=301, seq_len=1024)"
    same = job(tmp_path, transform=VLM[:-1] + ", image_token_id=300, seq_len=1024)", image_token_id=300)
    assert source_transform(same, same.sources[0]) == same.sources[0].transform
    clash = job(tmp_path, transform=VLM[:-1] + ", image_token_id=999)", image_token_id=300)
    with pytest.raises(ConfigError, match=r"sets image_token_id=999 but \[job\] image_token_id = 300"):
        source_transform(clash, clash.sources[0])
    clash = job(tmp_path, transform=VLM[:-1] + ", seq_len=2048)")
    with pytest.raises(ConfigError, match=r"sets seq_len=2048 but \[job\] seq_len = 1024"):
        source_transform(clash, clash.sources[0])
    text = msd.DGraph("t").source("a", "parquet", [str(tmp_path)]).mix({"a": 1.0}).pack(64, image_token_id=300).plan()
    assert source_transform(text, text.sources[0]) == "msdata_server.transforms:byte_tokens"


def test_which_jobs_have_image_keys(tmp_path):
    assert image_keys(job(tmp_path, transform="msdata_server.transforms:vlm(patch=16, merge=1)")) == ImageKeys(
        patch=16, merge=1
    )
    assert image_keys(job(tmp_path, transform="msdata_server.transforms:vlm(7, 4)")).row == 3 * 7 * 7
    text = msd.DGraph("t").source("a", "parquet", [str(tmp_path)]).mix({"a": 1.0})
    assert image_keys(text.plan()) is None
    assert image_keys(text.cost("vlm").plan()) == ImageKeys(patch=14, merge=2)  # the vlm defaults
    g = msd.DGraph("two").source("a", "parquet", [str(tmp_path)], columns=["i", "c"], transform=VLM)
    g.source("b", "parquet", [str(tmp_path)], columns=["i", "c"], transform="msdata_server.transforms:vlm(patch=16)")
    with pytest.raises(ConfigError, match="different \\(patch, merge\\)"):
        image_keys(g.mix({"a": 1.0, "b": 1.0}).plan())
    with pytest.raises(ConfigError, match="unexpected keyword argument 'size'"):
        image_keys(job(tmp_path, transform="msdata_server.transforms:vlm(size=3)"))
