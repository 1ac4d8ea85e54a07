"""The CPU path's startup line names its image library (Pillow or Pillow-SIMD) and libjpeg."""

import re
from importlib import metadata

import PIL

from infclip.data import transforms


def test_names_the_installed_pillow_and_a_libjpeg_version():
    got = transforms.pil_library()
    assert re.fullmatch(r"(Pillow|Pillow-SIMD) \S+ \((libjpeg-turbo \d+\.\d+\.\d+|libjpeg \S+|no JPEG support)\)",
                        got), got
    try:
        plain = metadata.version("pillow") == PIL.__version__  # the Pillow wheel provides PIL here
    except metadata.PackageNotFoundError:
        plain = False
    if plain:
        assert got.startswith(f"Pillow {PIL.__version__} (")


def test_names_pillow_simd_when_its_distribution_provides_pil(monkeypatch):
    real = metadata.version

    def version(dist):
        if dist.lower() == "pillow-simd":
            return PIL.__version__
        return real(dist)

    monkeypatch.setattr(metadata, "version", version)
    assert transforms.pil_library().startswith(f"Pillow-SIMD {PIL.__version__} (")


def test_a_stale_pillow_simd_record_under_pillow_is_not_taken(monkeypatch):
    """pip install of Pillow over Pillow-SIMD can leave the SIMD dist-info behind: the versions
    then differ and the line says Pillow."""
    def version(dist):
        if dist.lower() == "pillow-simd":
            return "0.0.0.post0"
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", version)
    assert transforms.pil_library().startswith(f"Pillow {PIL.__version__} (")
