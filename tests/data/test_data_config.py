"""check_data_config rejects impossible data settings with the key in the message."""

import pytest

from infclip.data.config import DataConfig, SourceConfig, check_data_config


@pytest.mark.parametrize("kw,key", [
    ({"loader_batch": 0}, "data.loader_batch"),
    ({"workers": -1}, "data.workers"),
    ({"num_samples": 0}, "data.num_samples"),
    ({"aug_scale": (0.5, 0.1)}, "data.aug_scale"),
    ({"aug_ratio": (0.0, 1.0)}, "data.aug_ratio"),
    ({"sources": [SourceConfig(shards="/x/{0..1}.tar", weight=0)]}, r"data.sources\[0\]"),
    ({"synthetic_image_size": 8}, "data.synthetic_image_size"),
    ({"stall_warn_s": -1.0}, "data.stall_warn_s"),
    ({"stall_abort_s": float("nan")}, "data.stall_abort_s"),
    ({"stall_warn_s": 60.0, "stall_abort_s": 30.0}, "data.stall_abort_s=30 must be larger than data.stall_warn_s=60"),
    ({"decode_threads": 0}, "data.decode_threads"),
    ({"decoder_options": "force_batch_single=0"}, r"data.decoder_options holds \['force_batch_single=0'\]"),
    ({"decoder_options": ":fancy_upsampling=1 nvjpeg_hw_decoder:force_batch_single"}, "not nvImageCodec options"),
    ({"decoder_options": ":fancy_upsampling=1", "decode": "cpu"}, "means nothing with data.decode=cpu"),
    ({"decoder_options": ":fancy_upsampling=1", "device_decoder": "nvjpeg"}, "means nothing with data.device_decoder=nvjpeg"),
])
def test_rejects(kw, key):
    with pytest.raises(ValueError, match=key):
        check_data_config(DataConfig(**kw))


def test_defaults_pass():
    check_data_config(DataConfig())
    check_data_config(DataConfig(stall_warn_s=0.0, stall_abort_s=0.0))  # 0: off
    check_data_config(DataConfig(decoder_options=" nvjpeg_hw_decoder:force_batch_single=0  :fancy_upsampling=1 "))
