"""A picture document's images and their placeholders never part: a document whose placeholders alone exceed
seq_len is a counted bad sample (``image_tokens_exceed_seq_len``), a max_pixels whose one image could exceed it
is refused when the job starts, and a document longer than seq_len keeps every placeholder and image in its
first piece (its text goes on in later pieces, which carry none), through a real server."""

from __future__ import annotations

import io
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd
from msdata_client.errors import ConfigError
from msdata_server.job.images import image_keys, source_transform
from msdata_server.sources.base import BAD_REASONS, BadSample
from msdata_server.transforms import check_image_fits, load_transform, max_image_tokens, run_transform, vlm

from .vlm_util import COLOURS, EOS, IMG, MERGE, PATCH, documents, read_with_status

Image = pytest.importorskip("PIL.Image")

SEQ = 64
FITS = SEQ * (PATCH * MERGE) ** 2  # 50176: one 224 x 224 image takes exactly seq_len placeholders
VLM = f"msdata_server.transforms:vlm(patch={PATCH}, merge={MERGE}, min_pixels=3136, max_pixels={FITS})"
SIDE = {4: 56, 16: 112, 36: 168, 64: 224}  # placeholders -> side of a square image that takes that many
FILLER = "and then the text runs on for a while past the end of a row "

# (placeholders and colour of each image, characters of text after the caption); None marks a bad document
DOCS = [
    ([(4, "red")], 0),  # short: one piece
    ([(4, "blue")], 150),  # longer than seq_len: three pieces, the image and its 4 placeholders in the first
    ([(64, "green")], 30),  # placeholders fill the first piece exactly; the text is all in the second
    ([(64, "red"), (64, "blue")], 10),  # 128 placeholders: bad
    ([(16, "yellow"), (16, "white"), (16, "black")], 100),  # three images, 48 placeholders, then text: split
    ([(36, "red"), (36, "green")], 0),  # 72 placeholders: bad (each image alone would fit)
    ([(16, "green"), (16, "red")], 20),
    ([(4, "black")], 200),  # four pieces
]
BAD = {3, 5}


def png(colour: str, side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), COLOURS[colour]).save(buf, "PNG")
    return buf.getvalue()


def caption(i: int, images, extra: int) -> str:
    return f"{' '.join(c for _, c in images)} doc{i} " + (FILLER * 4)[:extra]


def full_tokens(i: int) -> np.ndarray:
    """The whole token sequence of document i: its placeholders, its caption's bytes, EOS."""
    images, extra = DOCS[i]
    text = np.frombuffer(caption(i, images, extra).encode(), dtype=np.uint8).astype(np.int32)
    return np.concatenate([np.full(sum(n for n, _ in images), IMG, np.int32), text, [EOS]]).astype(np.int32)


@pytest.fixture
def picture_docs(tmp_path):
    rows = [([png(c, SIDE[n]) for n, c in images], caption(i, images, extra)) for i, (images, extra) in enumerate(DOCS)]
    table = pa.table({"image": [r[0] for r in rows], "caption": [r[1] for r in rows]})
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "docs.parquet", row_group_size=4)
    return tmp_path / "pq"


def picture_job(d, *, transform=VLM, long_docs="split"):
    g = msd.DGraph("bounds", seed=5)
    g.source("pq", "parquet", [str(d)], columns=["image", "caption"], transform=transform)
    g.mix({"pq": 1.0}).cost("vlm", alpha_v=1.0, beta_v=256.0)
    return g.pack(SEQ, micro_batches=2, long_docs=long_docs).mesh(dp=1).prefetch(2).plan()


# ---- the rule, without a server ------------------------------------------------------------------------------
def test_a_document_whose_placeholders_exceed_seq_len_is_a_bad_sample_naming_the_fix():
    assert "image_tokens_exceed_seq_len" in BAD_REASONS
    fn = vlm(patch=PATCH, merge=MERGE, min_pixels=3136, max_pixels=FITS, seq_len=SEQ)
    records = [{"image": [png(c, SIDE[n]) for n, c in DOCS[i][0]], "caption": "x"} for i in (2, 3, 5)]
    fits, two_big, two_mid = run_transform(fn, records, seed=0, sample_ids=[7, 8, 9])
    assert (fits.tokens == IMG).sum() == SEQ
    assert len(fits.image_grid_thw) == 1
    for bad, sid, n_ph, which in ((two_big, 8, 128, "its 2 images"), (two_mid, 9, 72, "its 2 images")):
        assert isinstance(bad, BadSample)
        assert bad.reason == "image_tokens_exceed_seq_len"
        assert bad.location == f"sample {sid}"
        assert f"{which}: {n_ph} image placeholder tokens, more than seq_len={SEQ}" in bad.detail
        assert "raise [job] seq_len or lower the vlm transform's max_pixels" in bad.detail
    # the first images over the limit stop it: the rest are not decoded (a corrupt one after them does not matter)
    many = {"image": [png("red", 224), png("blue", 224), b"not an image"], "caption": "x"}
    (bad,) = run_transform(fn, [many], seed=0, sample_ids=[1])
    assert bad.reason == "image_tokens_exceed_seq_len"
    assert "its first 2 of 3 images: 128 image placeholder tokens" in bad.detail
    (corrupt,) = run_transform(vlm(), [many], seed=0, sample_ids=[1])  # without a seq_len the third is decoded
    assert isinstance(corrupt, BadSample)
    assert corrupt.reason == "corrupt"


def test_a_max_pixels_whose_one_image_cannot_fit_is_refused(tmp_path):
    assert max_image_tokens(patch=PATCH, merge=MERGE, max_pixels=FITS) == SEQ
    assert max_image_tokens(patch=PATCH, merge=MERGE, max_pixels=FITS + 783) == SEQ  # a block short of one more
    fix = f"lower max_pixels to at most {FITS} or raise \\[job\\] seq_len to at least 65"
    with pytest.raises(ConfigError, match=f"vlm: max_pixels={FITS + 784} lets one image take up to 65 .*{fix}"):
        check_image_fits(patch=PATCH, merge=MERGE, max_pixels=FITS + 784, seq_len=SEQ)
    check_image_fits(patch=PATCH, merge=MERGE, max_pixels=FITS + 783, seq_len=SEQ)
    with pytest.raises(ConfigError, match="seq_len=0 must be an integer >= 1"):
        vlm(seq_len=0)
    big = picture_job(tmp_path, transform=VLM.replace(f"max_pixels={FITS}", f"max_pixels={FITS + 784}"))
    for check in (image_keys, lambda spec: source_transform(spec, spec.sources[0])):
        with pytest.raises(ConfigError, match=f"source 'pq': max_pixels={FITS + 784} .*{fix}"):
            check(big)
    ok = picture_job(tmp_path)
    assert source_transform(ok, ok.sources[0]) == VLM[:-1] + f", seq_len={SEQ})"
    # the default max_pixels (1024 x 1024: up to 1337 placeholders) is no choice of the job's: not refused; an
    # image that large is a bad sample of the transform the job runs, a small one goes through
    plain = picture_job(tmp_path, transform=f"msdata_server.transforms:vlm(patch={PATCH}, merge={MERGE})")
    assert image_keys(plain) is not None
    fn = load_transform(source_transform(plain, plain.sources[0]))
    records = [{"image": png("red", 56), "caption": "s"}, {"image": png("red", 400), "caption": "l"}]
    small, large = run_transform(fn, records, seed=0, sample_ids=[1, 2])
    assert (small.tokens == IMG).sum() == 4
    assert large.reason == "image_tokens_exceed_seq_len"
    assert "its image: 196 image placeholder tokens" in large.detail


# ---- through a real server -----------------------------------------------------------------------------------
@pytest.mark.parametrize("long_docs", ["split", "truncate"])
def test_images_and_placeholders_stay_in_a_documents_first_piece(server_factory, picture_docs, long_docs):
    spec = picture_job(picture_docs, long_docs=long_docs)
    pieces = {i: math.ceil(len(full_tokens(i)) / SEQ) if long_docs == "split" else 1 for i in range(len(DOCS))}
    n = 3 * sum(p for i, p in pieces.items() if i not in BAD)  # three epochs at least: every piece at least once
    srv = server_factory(workers=1).start()
    got, st = read_with_status(spec, srv.socket, n)
    seen: dict[int, set[int]] = {}
    for b in got[0]:
        for doc in documents(b):  # (checks placeholders == t*h*w / merge^2 of the images it carries)
            i, seg = doc["sid"], doc["tokens"]
            assert i not in BAD, f"document {i} has more placeholders than seq_len and was delivered"
            full = full_tokens(i)
            ks = [k for k in range(pieces[i]) if np.array_equal(seg, full[k * SEQ : (k + 1) * SEQ])]
            assert len(ks) == 1, f"document {i}: a piece that is no cut of it at a multiple of seq_len: {seg}"
            seen.setdefault(i, set()).add(ks[0])
            if ks[0] > 0:
                assert not doc["images"], f"document {i} piece {ks[0]} has image parts"
                assert not (seg == IMG).any(), f"document {i} piece {ks[0]} has image parts"
                continue
            images = DOCS[i][0]
            assert doc["n_ph"] == sum(p for p, _ in images)  # every placeholder in the first piece...
            assert len(doc["images"]) == len(images)  # ...with every image, in order, each its own colour
            for (pixels, thw), (p, colour) in zip(doc["images"], images):
                assert int(thw.prod()) // MERGE**2 == p
                got_rgb = pixels.reshape(-1, 3, PATCH * PATCH).astype(np.float64).mean(axis=(0, 2))
                assert np.abs(got_rgb - COLOURS[colour]).max() <= 3.0, (i, colour, got_rgb)
    # every piece of every document at least once (truncating, the planner may hold a short document back until
    # it can fill a row with it; the documents truncation cuts are those this test is about)
    must = {i for i in pieces if i not in BAD and (long_docs == "split" or len(full_tokens(i)) > SEQ)}
    assert must <= set(seen) <= set(pieces) - BAD
    assert {2, 4} <= must
    assert all(seen[i] == set(range(pieces[i])) for i in seen)
    (job,) = st["jobs"]
    bad = job["sources"]["pq"]["bad_samples"]
    assert set(bad) == {"image_tokens_exceed_seq_len"}
    assert bad["image_tokens_exceed_seq_len"] >= len(BAD)


def test_a_job_whose_one_image_cannot_fit_fails_at_its_start(server_factory, picture_docs):
    spec = picture_job(picture_docs, transform=VLM.replace(f"max_pixels={FITS}", "max_pixels=1003520"))
    srv = server_factory(workers=1).start()
    with (
        msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc,
        pytest.raises(ConfigError, match=rf"source 'pq': max_pixels=1003520 .* lower max_pixels to at most {FITS}"),
    ):
        next(dc)
