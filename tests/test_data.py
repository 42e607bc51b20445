"""Data: sources and their errors, the assistant loss mask, self-distillation that survives SIGKILL."""
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import chats_file, make_tokenizer
from tiny_models import dialogues_file
from draftsmith.data import sources
from draftsmith.data.chat import tokenize_chat
from draftsmith.data.distill import DataSettings, make_data
from draftsmith.heads.draft_vocab import d2t_offsets, draft_vocabulary, t2d_mask

REPO = Path(__file__).resolve().parents[1]


def test_multi_turn_loss_mask_covers_assistant_tokens_only():
    tok = make_tokenizer()
    messages = [{"role": "system", "content": "you are a good help"},
                {"role": "user", "content": "what is the time"},
                {"role": "assistant", "content": "the time is one"},
                {"role": "user", "content": "and the day"},
                {"role": "assistant", "content": "the day is two"}]
    chat = tokenize_chat(tok, messages)
    trained = [tok.convert_ids_to_tokens(i) for i, m in zip(chat.input_ids, chat.loss_mask) if m]
    assert trained == ["the", "time", "is", "one", "<|im_end|>", "the", "day", "is", "two", "<|im_end|>"]
    untrained = [tok.convert_ids_to_tokens(i) for i, m in zip(chat.input_ids, chat.loss_mask) if not m]
    assert "assistant" in untrained and "what" in untrained and "good" in untrained


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines))
    return path


def test_jsonl_cut_off_at_the_end_keeps_what_is_whole(tmp_path, caplog):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    path = write_lines(tmp_path / "cut.jsonl", [good, good, b'{"messages": [{"role": "us'])
    stats = sources.SourceStats()
    with caplog.at_level(logging.WARNING):
        convs = list(sources.jsonl(path, stats=stats))
    assert len(convs) == 2 and stats.truncated_tail
    assert "cut off" in caplog.text


def test_jsonl_non_utf8_line_is_an_error_naming_the_line(tmp_path):
    good = json.dumps({"prompt": "hello"}).encode()
    path = write_lines(tmp_path / "bad.jsonl", [good, b'{"prompt": "caf\xe9"}', good])
    with pytest.raises(sources.DataError, match=r"bad.jsonl:2: not UTF-8"):
        list(sources.jsonl(path))


def test_empty_conversations_and_turns_are_skipped_and_counted(tmp_path):
    rows = [{"conversations": []},
            {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""},
                               {"from": "human", "value": "again"}]}]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    stats = sources.SourceStats()
    convs = list(sources.jsonl(path, stats=stats))
    assert len(convs) == 1 and stats.skipped_empty_conversations == 2 and stats.skipped_empty_turns == 2
    assert convs[0].messages == [{"role": "user", "content": "hi\n\nagain"}]


def test_sharegpt_stream_stops_at_a_cut_off_record(tmp_path, caplog):
    record = {"id": "a", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "yo"}]}
    text = "[\n" + ",\n".join(json.dumps(dict(record, id=str(i))) for i in range(5)) + ',\n{"id": "x", "conv'
    path = tmp_path / "share.json"
    path.write_text(text)
    stats = sources.SourceStats()
    with caplog.at_level(logging.WARNING):
        convs = list(sources.sharegpt(path=path, stats=stats))
    assert [c.id for c in convs] == ["0", "1", "2", "3", "4"] and stats.truncated_tail
    assert caplog.text.count("cut off") == 1


def test_draft_vocabulary_round_trip():
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 3, 0])
    vocab = draft_vocabulary(counts, 4, always=[7])
    assert vocab.tolist() == [1, 3, 5, 7]                      # the 3 most frequent + the stop token, ascending
    d2t = d2t_offsets(vocab)
    assert (torch.arange(4) + d2t).tolist() == vocab.tolist()  # target_id = draft_id + d2t[draft_id]
    assert t2d_mask(vocab, 8).nonzero().flatten().tolist() == vocab.tolist()
    with pytest.raises(ValueError, match="draft_vocab_size=9"):
        draft_vocabulary(counts, 9)


def test_make_data_writes_ids_and_features_and_refuses_other_settings(tiny_target, tmp_path):
    import datasets
    from draftsmith.data import features as feature_cache
    from draftsmith.data.distill import read_shard, shard_paths

    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 6)), max_conversations=None, batch_size=4,
                            max_new_tokens=12)
    layers = [0, 1, tiny_target.num_layers]
    report = make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False, capture_layers=layers)
    assert report.conversations == 6 and report.generated_tokens > 0
    table = datasets.load_from_disk(str(tmp_path / "data" / "tokenized"))
    assert table.num_rows == 6 and set(table.column_names) >= {"input_ids", "loss_mask", "shard", "row"}
    records = [r for shard in shard_paths(tmp_path / "data") for r in read_shard(shard)]
    for record in records:      # the reply is exactly what the target generated: plain greedy decoding
        from draftsmith.heads.decoding.verifier import decode
        prompt_len = record["loss_mask"].index(1)
        reply = decode(tiny_target, record["input_ids"][:prompt_len], 12).tokens
        assert record["input_ids"][prompt_len:] == reply
    # captured while generating == computed by a fresh forward over the same ids (bf16 storage)
    first = shard_paths(tmp_path / "data")[0]
    reader = feature_cache.ShardReader(feature_cache.cache_dir(tmp_path / "data", layers) / (first.stem + ".safetensors"),
                                       layers, tiny_target.identity.weights_sha256)
    fresh = feature_cache.compute_features(tiny_target, read_shard(first), layers)
    for row, expected in enumerate(fresh):
        got = reader.record(row).float()
        assert torch.allclose(got[:-1], expected[:-1].float(), atol=0.03, rtol=0.02)   # last token: never fed
    with pytest.raises(ValueError, match="other settings"):
        make_data(tiny_target, DataSettings(source=settings.source, temperature=0.7), tmp_path / "data", seed=0)


def test_corrupted_feature_shard_is_named_and_only_it_is_rebuilt(tiny_target, tmp_path):
    from draftsmith.data import features as feature_cache
    from draftsmith.data.distill import shard_paths

    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 8)), max_conversations=None, batch_size=2,
                            max_new_tokens=8)
    layers = [1, tiny_target.num_layers]
    make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False, capture_layers=layers)
    cache = feature_cache.cache_dir(tmp_path / "data", layers)
    victim = cache / "shard-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF                                   # flip bits inside the feature bytes
    victim.write_bytes(bytes(data))
    others = {p.name: p.stat().st_mtime_ns for p in cache.glob("*.safetensors") if p != victim}
    with pytest.raises(feature_cache.CacheError, match="shard-00002.safetensors is corrupted"):
        feature_cache.ShardReader(victim, layers, tiny_target.identity.weights_sha256)
    rebuilt = feature_cache.build_missing(tiny_target, shard_paths(tmp_path / "data"), layers, cache, progress=False)
    assert rebuilt == 1
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("*.safetensors") if p != victim} == others
    feature_cache.ShardReader(victim, layers, tiny_target.identity.weights_sha256)      # whole again
    with pytest.raises(feature_cache.CacheError, match="another target"):
        feature_cache.ShardReader(victim, layers, "0123456789abcdef")
    with pytest.raises(feature_cache.CacheError, match="holds layers"):
        feature_cache.ShardReader(victim, [0, 1], tiny_target.identity.weights_sha256)


def test_prefill_labels_are_the_targets_own_at_every_reply_position(tiny_target, tmp_path):
    """mode=prefill keeps the source's text (both assistant turns) and labels it with the target's own
    next-token choice, recomputed from the cached final layer: it must equal the model's own argmax."""
    from draftsmith.data.distill import read_shard, shard_paths
    from draftsmith.heads.medusa import Medusa, MedusaConfig
    from draftsmith.train.batches import FeatureSource, collate

    settings = DataSettings(source=str(dialogues_file(tmp_path / "d.jsonl", 6)), mode="prefill",
                            max_conversations=None, batch_size=3)
    N = tiny_target.num_layers
    report = make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False, capture_layers=[N])
    assert report.generated_tokens == 0 and report.prefilled_tokens > 0 and report.conversations == 6
    rows = []
    for shard in shard_paths(tmp_path / "data"):
        for row, record in enumerate(read_shard(shard)):
            assert record["messages"][3]["content"] in tiny_target.tokenizer.decode(record["input_ids"])
            starts = sum(1 for a, b in zip([0] + record["loss_mask"], record["loss_mask"]) if b and not a)
            assert starts == 2                                   # both assistant turns are trained on
            rows.append({**record, "shard": shard.stem, "row": row})
    from draftsmith.data import features as feature_cache
    cache = FeatureSource(feature_cache.cache_dir(tmp_path / "data", [N]), [N], tiny_target.identity.weights_sha256)
    batch = collate(rows)
    batch["features"] = cache.batch(rows, batch["input_ids"].shape[1])
    labels = Medusa(MedusaConfig(num_heads=2), tiny_target)._next_tokens(batch)          # [b, s]
    with torch.no_grad():
        own = tiny_target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    scored = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1)).bool()     # the next token is a reply token
    agree = (labels[scored] == own[scored]).float().mean().item()
    source_agree = (torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))[scored] == own[scored]).float().mean()
    assert agree >= 0.97, agree                 # bf16 cache: a near-tie may flip, nothing more
    assert source_agree < 0.5                   # and the labels are not the source's text


def test_greedy_regenerated_replies_are_the_targets_own_labels(tiny_target, tmp_path):
    """After greedy regeneration every reply token is the target's argmax, so Medusa reads its labels from
    the data (no full-vocabulary head per training step); recomputing them agrees but for bf16 near-ties."""
    from draftsmith.data import features as feature_cache
    from draftsmith.data.distill import read_shard, shard_paths
    from draftsmith.heads.medusa import Medusa, MedusaConfig
    from draftsmith.train.batches import FeatureSource, collate
    from draftsmith.train.loop import build_drafter
    from draftsmith.train.settings import recipe_from_dict

    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 8)), max_conversations=None, batch_size=4,
                            max_new_tokens=16)
    N = tiny_target.num_layers
    make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False, capture_layers=[N])
    rows = [{**r, "shard": s.stem, "row": i} for s in shard_paths(tmp_path / "data") for i, r in enumerate(read_shard(s))]
    cache = FeatureSource(feature_cache.cache_dir(tmp_path / "data", [N]), [N], tiny_target.identity.weights_sha256)
    batch = collate(rows)
    batch["features"] = cache.batch(rows, batch["input_ids"].shape[1])
    medusa = Medusa(MedusaConfig(num_heads=2), tiny_target)
    recomputed = medusa._next_tokens(batch)
    medusa.data_is_target_greedy = True
    from_data = medusa._next_tokens(batch)
    scored = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1)).bool()
    assert scored.sum() > 50
    assert (from_data[scored] == recomputed[scored]).float().mean().item() >= 0.97
    for data, greedy in (({}, True), ({"temperature": 0.7}, False), ({"mode": "prefill"}, False)):
        recipe = recipe_from_dict({"method": "medusa", "data": data, "drafter": {"draft_vocab_size": None}})
        assert build_drafter(recipe, tiny_target, {}).data_is_target_greedy is greedy


def test_training_refuses_data_made_for_another_recipe(tiny_target, tmp_path):
    from draftsmith.train.batches import load_training_data
    from draftsmith.train.settings import recipe_from_dict

    first = dialogues_file(tmp_path / "a.jsonl", 8)
    raw = {"method": "medusa", "output_dir": str(tmp_path / "run"), "target": {"path": str(tiny_target.source)},
           "data": {"source": str(first), "mode": "prefill", "max_conversations": None, "batch_size": 4},
           "drafter": {"num_heads": 2}}
    load_training_data(recipe_from_dict(raw), tiny_target)                         # makes the data
    raw["data"]["source"] = str(dialogues_file(tmp_path / "b.jsonl", 8))
    with pytest.raises(ValueError, match=r"other settings \(source: on disk '.*a.jsonl', recipe '.*b.jsonl'"):
        load_training_data(recipe_from_dict(raw), tiny_target)
    raw["data"].update(source=str(first), mode="regenerate")
    with pytest.raises(ValueError, match=r"mode: on disk 'prefill', recipe 'regenerate'"):
        load_training_data(recipe_from_dict(raw), tiny_target)


def test_mix_regenerates_its_share_of_batches():
    from draftsmith.data.distill import batch_regenerates
    settings = DataSettings(mode="mix", regenerate_share=0.25)
    assert [batch_regenerates(settings, i) for i in range(8)] == [False, False, False, True] * 2
    assert DataSettings(regenerate=False).mode == "prefill"
    with pytest.raises(ValueError, match="data.mode"):
        DataSettings(mode="distill")


DATA_SCRIPT = """
import sys
from draftsmith.data.distill import DataSettings, make_data
from draftsmith.heads.runtime.target import Target
target = Target.load(sys.argv[1], "float32", "cpu")
make_data(target, DataSettings(source=sys.argv[2], max_conversations=None, batch_size=2, max_new_tokens=48,
                               temperature=0.9, mode=sys.argv[4], regenerate_share=0.5), sys.argv[3], seed=5,
          progress=False, capture_layers=[target.num_layers])
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["regenerate", "mix"])
def test_data_generation_killed_and_restarted_loses_and_duplicates_nothing(tiny_target_dir, tmp_path, mode):
    source = (chats_file if mode == "regenerate" else dialogues_file)(tmp_path / "chats.jsonl", 60)
    script = tmp_path / "make.py"
    script.write_text(DATA_SCRIPT)
    env = dict(os.environ)
    run = [sys.executable, str(script), str(tiny_target_dir), str(source)]

    subprocess.run(run + [str(tmp_path / "whole"), mode], check=True, env=env, timeout=600)

    shards = tmp_path / "killed" / "shards"
    proc = subprocess.Popen(run + [str(tmp_path / "killed"), mode], env=env)
    deadline = time.time() + 300
    while not (shards / "shard-00003.jsonl").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished_before_kill = len(list(shards.glob("shard-*.jsonl")))
    assert 0 < finished_before_kill < 30, "the kill did not land mid-run; the test exercised nothing"
    subprocess.run(run + [str(tmp_path / "killed"), mode], check=True, env=env, timeout=600)

    def records(directory):
        lines = []
        for shard in sorted((directory / "shards").glob("shard-*.jsonl")):
            lines += [json.loads(x) for x in shard.read_text().splitlines() if x.strip()]
        return lines
    whole, resumed = records(tmp_path / "whole"), records(tmp_path / "killed")
    assert [r["id"] for r in resumed] == [r["id"] for r in whole]          # nothing lost, nothing twice
    assert resumed == whole                                                 # sampling is seeded per batch
    assert not list(shards.glob("*.tmp*"))
    if mode == "mix":                                   # both kinds of batch are there, each with its features
        assert any(0 in r["loss_mask"][r["loss_mask"].index(1):] for r in resumed)     # prefilled: two turns
        cache = tmp_path / "killed" / "data" / "features"
        features = sorted((tmp_path / "killed" / "features").glob("L*/shard-*.safetensors"))
        assert len(features) == len(list(shards.glob("shard-*.jsonl"))), cache


@pytest.mark.parametrize("mode", ["skip", "truncate"])
def test_prompts_longer_than_the_maximum_are_skipped_or_truncated_and_counted(tiny_target, tmp_path, mode):
    words = ["the", "time", "is", "one", "of", "the", "day", "and", "the", "night", "of", "water"]
    rows = [{"id": "short", "messages": [{"role": "user", "content": "the day"}]},
            {"id": "long", "messages": [{"role": "user", "content": " ".join(words * 12)}]}]
    source = tmp_path / "c.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows))
    settings = DataSettings(source=str(source), max_conversations=None, batch_size=2, max_new_tokens=8,
                            max_prompt_tokens=40, long_prompts=mode)
    report = make_data(tiny_target, settings, tmp_path / mode, seed=0, progress=False)
    if mode == "skip":
        assert report.skipped_long_prompts == 1 and report.truncated_prompts == 0 and report.conversations == 1
    else:
        assert report.truncated_prompts == 1 and report.skipped_long_prompts == 0 and report.conversations == 2
        from draftsmith.data.distill import read_shard, shard_paths
        long = next(r for s in shard_paths(tmp_path / mode) for r in read_shard(s) if r["id"] == "long")
        assert long["loss_mask"].index(1) <= 40                    # the prompt part fits the maximum


def test_continuous_batching_gives_one_by_one_greedy_output_and_features(tiny_target, monkeypatch):
    """Rows are refilled from the queue and the cache repacked; in fp32 greedy output must equal plain
    one-by-one decoding token for token, and the captured features those of a fixed batch."""
    from collections import Counter

    from draftsmith.data.generate import generate_batch
    from draftsmith.data.stream import generate_stream
    from draftsmith.heads.decoding.verifier import decode

    words = "the time is one of the day and the night of water fish sea".split()
    prompts = [tiny_target.tokenizer(" ".join(words[i % 7: i % 7 + 2 + (i * 5) % 9]))["input_ids"] for i in range(11)]
    # a stop token that ends some replies early and others late, so rows finish at different steps
    replies = [decode(tiny_target, p, 20).tokens for p in prompts]
    firsts = Counter(t for r in replies for t in dict.fromkeys(r))
    stop = max(firsts, key=lambda t: (0 < firsts[t] < len(prompts),
                                      len({r.index(t) for r in replies if t in r})))
    monkeypatch.setattr(tiny_target, "eos_token_ids", [stop])
    layers = [1, tiny_target.num_layers]
    streamed = generate_stream(tiny_target, prompts, 20, rows=3, capture_layers=layers)
    fixed = generate_batch(tiny_target, prompts, 20, capture_layers=layers)
    lengths = {len(s.token_ids) for s in streamed}
    assert len(lengths) > 1, "every reply had the same length: no row was refilled mid-run"
    for prompt, got, batch in zip(prompts, streamed, fixed):
        assert got.token_ids == decode(tiny_target, prompt, 20).tokens
        assert got.features.shape == batch.features.shape
        assert torch.allclose(got.features.float(), batch.features.float(), atol=0.03, rtol=0.02)


def test_continuous_batching_samples_do_not_depend_on_the_batch(tiny_target):
    from draftsmith.data.stream import generate_stream

    prompts = [tiny_target.tokenizer("the day and " + "night " * (i % 4))["input_ids"] for i in range(8)]

    def run(rows):
        generators = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
        return [g.token_ids for g in generate_stream(tiny_target, prompts, 16, rows=rows, temperature=1.0,
                                                      generators=generators)]
    three, eight = run(3), run(8)
    assert three == eight
    assert len({tuple(t) for t in three}) > 1                   # and they are samples, not one reply


def test_past_the_time_cap_shards_in_flight_are_left_unwritten_even_before_the_first(tiny_target):
    """The cap holds within one decode step, a shard written yet or not: shards in flight are left for a
    rerun (their finished conversations go to parts, tested below), never half-written."""
    import time as clock

    from draftsmith.data.regenerate import Regenerator
    from draftsmith.data.sources import Conversation

    settings = DataSettings(batch_size=3, max_new_tokens=8)
    convs = [Conversation(f"c{i}", [{"role": "user", "content": "the day and the night " * (1 + i % 3)}])
             for i in range(9)]
    written = []
    counts = {"generated_tokens": 0, "skipped_long_prompts": 0, "truncated_prompts": 0}
    engine = Regenerator(tiny_target, settings, 0, counts, None, (), lambda i, r: written.append((i, len(r))),
                         deadline=clock.time() + 3600)
    engine.admit(0, convs[:3])                 # in time: the first shard completes
    assert written == [(0, 3)] and not engine.out_of_time
    engine.deadline = engine.stream.deadline = clock.time() - 1                # now past
    engine.admit(1, convs[3:6])
    engine.finish()
    assert written == [(0, 3)] and list(engine.inflight) == [1]      # left for a rerun, not half-written
    late = Regenerator(tiny_target, settings, 0, counts, None, (), lambda i, r: written.append((i, len(r))),
                       deadline=clock.time() - 1)                    # past before anything was written
    late.admit(2, convs[6:])
    late.finish()
    assert written == [(0, 3)] and list(late.inflight) == [2]


def test_at_the_time_cap_finished_conversations_are_kept_and_a_rerun_makes_the_rest(tiny_target_dir, tmp_path,
                                                                                     monkeypatch):
    """The cap lands while shards are in flight: their finished conversations are written as parts, a rerun
    makes only the rest, and parts plus the rest hold exactly what an uninterrupted run writes."""
    from draftsmith.data import features as feature_cache
    from draftsmith.data.distill import make_data, read_shard, shard_paths
    from draftsmith.data.regenerate import Regenerator

    def records_in(directory):
        return {r["id"]: r for s in shard_paths(directory) for r in read_shard(s)}
    source = dialogues_file(tmp_path / "d.jsonl", 24)
    settings = DataSettings(source=str(source), max_conversations=None, batch_size=4, max_new_tokens=10,
                            max_turns=2, temperature=0.8)
    from draftsmith.heads.runtime.target import Target
    tiny_target = Target.load(str(tiny_target_dir), "float32")
    layers = [tiny_target.num_layers]
    make_data(tiny_target, settings, tmp_path / "probe", seed=3, progress=False)
    # a frequent reply token counts as a stop token here, so replies end at different steps, as real ones do
    from collections import Counter
    counts = Counter(t for r in records_in(tmp_path / "probe").values()
                     for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    tiny_target.eos_token_ids = tiny_target.eos_token_ids + [counts.most_common(3)[-1][0]]
    make_data(tiny_target, settings, tmp_path / "whole", seed=3, progress=False, capture_layers=layers)

    def cap_mid_shard(self):     # the clock runs out as soon as a shard in flight has a finished conversation
        return self.written >= 1 and any(w.finished and w.open for w in self.inflight.values())
    with monkeypatch.context() as patch:
        patch.setattr(Regenerator, "out_of_time", property(cap_mid_shard))
        make_data(tiny_target, settings, tmp_path / "capped", seed=3, progress=False, capture_layers=layers)
    parts = sorted((tmp_path / "capped" / "shards").glob("shard-*.part*.jsonl"))
    assert parts, "no shard was in flight with finished conversations at the cap; the test exercised nothing"
    kept = {r["id"] for p in parts for r in read_shard(p)}
    assert len(records_in(tmp_path / "capped")) < 24
    make_data(tiny_target, settings, tmp_path / "capped", seed=3, progress=False, capture_layers=layers)

    whole, resumed = records_in(tmp_path / "whole"), records_in(tmp_path / "capped")
    assert resumed == whole                                  # nothing lost, nothing twice, the same samples
    rest = {r["id"] for s in shard_paths(tmp_path / "capped") if ".part" not in s.name for r in read_shard(s)}
    assert not kept & rest
    cache = feature_cache.cache_dir(tmp_path / "capped", layers)
    assert sorted(p.stem for p in cache.glob("shard-*.safetensors")) == [s.stem for s in
                                                                          shard_paths(tmp_path / "capped")]


def test_any_dataset_through_load_dataset_parquet_with_a_column_mapping(tiny_target, tmp_path):
    """A Parquet file written here: its turns column named by data.messages_field, or its prompt column
    by data.prompt_field, streamed or not; a missing column and an uncached dataset id are named."""
    import datasets
    from draftsmith.data import sources

    rows = {"chat": [[{"role": "user", "content": f"question {i} about the day"},
                      {"role": "assistant", "content": f"answer {i} is the night"}] for i in range(6)],
            "question": [f"question {i} about water" for i in range(6)], "id": [f"p{i}" for i in range(6)]}
    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(parquet))
    for streaming in (False, True):
        convs = list(sources.conversations(str(parquet), columns=sources.Columns(messages_field="chat",
                                                                                  streaming=streaming)))
        assert [c.id for c in convs] == rows["id"] and convs[2].messages == rows["chat"][2]
    prompts = list(sources.conversations(str(parquet), columns=sources.Columns(prompt_field="question")))
    assert [c.messages for c in prompts][4] == [{"role": "user", "content": "question 4 about water"}]
    with pytest.raises(sources.DataError, match=r"has no column 'turns' \(it has \['chat', 'question', 'id'\]\)"):
        list(sources.conversations(str(parquet), columns=sources.Columns(messages_field="turns")))
    with pytest.raises(sources.DataError, match=r"'nobody/no-such-dataset' .* not in the local Hugging Face cache"):
        list(sources.conversations("nobody/no-such-dataset"))
    settings = DataSettings(source=str(parquet), messages_field="chat", mode="prefill", max_conversations=None,
                            batch_size=4)
    report = make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False)
    assert report.conversations == 6
    table = datasets.load_from_disk(str(tmp_path / "data" / "tokenized"))
    assert sorted(table["id"]) == rows["id"] and all(sum(m) > 0 for m in table["loss_mask"])
    with pytest.raises(ValueError, match="name two ways to read a chat"):
        DataSettings(messages_field="chat", prompt_field="question")


def test_a_max_seq_len_past_the_targets_context_is_refused_before_any_work(tiny_target, tmp_path):
    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 4)), max_seq_len=4096)
    with pytest.raises(ValueError, match=r"data\.max_seq_len=4096 is larger than the context of target .*2048 "
                                         r"positions.*set data\.max_seq_len=2048 or less"):
        make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False)
    assert not (tmp_path / "data").exists()
