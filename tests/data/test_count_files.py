"""sizes.json and *_stats.json are checked before they are trusted: a malformed file or an
impossible count is one DataError naming the file and the fix, at preflight."""

import io
import json
import tarfile

import pytest

from infclip.data.config import DataConfig
from infclip.data.pipeline import resolve_sources
from infclip.data.shards import DataError, count_samples


def _shards(tmp_path, n=2):
    urls = []
    for i in range(n):
        path = tmp_path / f"{i:05d}.tar"
        with tarfile.open(path, "w") as tar:
            info = tarfile.TarInfo("a.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        urls.append(str(path))
    return urls


@pytest.mark.parametrize("content, match", [
    ("{not json", r"sizes.json cannot be read as JSON"),
    ("[1, 2]", r"sizes.json holds a list, not a \{shard name: count\} object"),
    ('{"00000.tar": -3, "00001.tar": 4}', r"the count of '00000.tar' is -3, not a sample count"),
    ('{"00000.tar": "many", "00001.tar": 4}', r"the count of '00000.tar' is 'many'"),
    ('{"00000.tar": 2.5, "00001.tar": 4}', r"is 2.5, not a sample count"),
    ('{"00000.tar": 0, "00001.tar": 0}', r"say the 2 shards hold 0 samples"),
])
def test_a_bad_sizes_json_is_refused_naming_it(tmp_path, content, match):
    urls = _shards(tmp_path)
    (tmp_path / "sizes.json").write_text(content)
    with pytest.raises(DataError, match=match):
        count_samples(urls)
    cfg = DataConfig(kind="wds", shards=str(tmp_path / "{00000..00001}.tar"))
    with pytest.raises(DataError, match=r"data.num_samples"):  # the preflight's path, with the fix
        resolve_sources(cfg)


@pytest.mark.parametrize("stats, match", [
    ("garbage", r"00000_stats.json cannot be read as JSON"),
    ('{"count": 5}', r'00000_stats.json has no "successes" count'),
    ('{"successes": true}', r'"successes" is True, not a sample count'),
])
def test_a_bad_stats_file_is_refused_naming_it(tmp_path, stats, match):
    urls = _shards(tmp_path, 1)
    (tmp_path / "00000_stats.json").write_text(stats)
    with pytest.raises(DataError, match=match):
        count_samples(urls)


def test_good_counts_still_add_up_and_num_samples_skips_the_files(tmp_path):
    urls = _shards(tmp_path)
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 3, "00001.tar": 4}))
    assert count_samples(urls) == 7
    (tmp_path / "sizes.json").write_text("{broken")
    cfg = DataConfig(kind="wds", shards=str(tmp_path / "{00000..00001}.tar"), num_samples=10)
    assert resolve_sources(cfg)[0].num_samples == 10


def test_a_fifo_among_the_shards_is_refused_at_preflight(tmp_path):
    import os

    from infclip.data.shards import check_exist

    urls = _shards(tmp_path)
    os.mkfifo(tmp_path / "00002.tar")
    with pytest.raises(DataError, match=r"shard .*00002.tar is not a regular file \(a FIFO"):
        check_exist(urls + [str(tmp_path / "00002.tar")])
    check_exist(urls)


def test_a_failing_pipe_command_keeps_its_samples_and_counts_one_pipe_error(tmp_path):
    """`cat shard; exit 3`: every sample of the stream is read, then pipe_error is counted,
    whatever the timing of the command's exit (webdataset's Pipe raised mid-stream at times)."""
    from collections import Counter

    from infclip.data.shards import iter_samples

    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(20):
            info = tarfile.TarInfo(f"{i:03d}.txt")
            info.size = 4000
            tar.addfile(info, io.BytesIO(b"x" * 4000))
    for _ in range(5):
        counts = Counter()
        keys = [s["__key__"] for s in iter_samples(f"pipe:cat {path}; exit 3", counts)]
        assert len(keys) == 20 and counts == Counter(pipe_error=1), (len(keys), counts)
    counts = Counter()
    assert len(list(iter_samples(f"pipe:cat {path}", counts))) == 20 and not counts
    # the archive's padding after its end block, larger than a pipe's buffer: the command is still
    # writing when tarfile stops; it is drained, exits 0, and nothing is counted
    counts = Counter()
    assert len(list(iter_samples(f"pipe:cat {path}; head -c 262144 /dev/zero", counts))) == 20 and not counts
    counts = Counter()  # more than PIPE_DRAIN_BYTES after the archive: ended, not counted as failed
    assert len(list(iter_samples(f"pipe:cat {path}; cat /dev/zero", counts))) == 20 and not counts
    stream = iter_samples(f"pipe:cat {path}; sleep 60", Counter())
    next(stream)
    stream.close()  # a reader that stops early ends the command, counts nothing, does not wait


@pytest.mark.parametrize("claimed, warned", [(2000, "epochs repeat its samples"), (40, None),
                                             (4, "an epoch ends before most samples were read")])
def test_a_first_pass_far_from_the_claimed_count_warns_with_both_numbers(capsys, tmp_path, claimed, warned):
    from collections import Counter

    from infclip.data.stream import StreamSpec, raw_stream

    urls = _shards(tmp_path, 4)  # each holds one sample ("a")
    with tarfile.open(urls[0], "w") as tar:
        for i in range(37):
            info = tarfile.TarInfo(f"{i:03d}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    spec = StreamSpec(urls, [1.0] * 4, False, 0, 0, 1, 1, claimed, 0)  # 40 samples, loader_batch 1
    stream = raw_stream(spec, 0, 0, Counter())  # epoch 0, stream 0 (the only one)
    read = 0
    while next(stream) is not None:
        read += 1
    err = capsys.readouterr().err
    assert read == 40
    if warned is None:
        assert err == ""
    else:
        assert f"read 40 samples, but the sample counts (sizes.json / *_stats.json / data.num_samples) give it " \
               f"{claimed} per epoch" in err and warned in err
