"""Images in prompts (Qwen3.5's vision tower, M-RoPE positions): greedy tokens identical to
transformers' Qwen3_5ForConditionalGeneration on CPU in fp32, through chunked prefill and the
prefix cache, which must tell two images apart."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from deltaserve import LLM, SamplingParams

PIL = pytest.importorskip("PIL.Image")

IMAGE, START, END = 150, 152, 153
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(vision_checkpoint) -> str:
    return vision_checkpoint


def processor_config(path: str) -> dict:
    with open(os.path.join(path, "preprocessor_config.json")) as f:
        return json.load(f)


def image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def solid(value: int, size: tuple[int, int]):
    return PIL.fromarray(np.full((size[1], size[0], 3), value, dtype=np.uint8))


_HF_IN_SUBPROCESS = """
import json, sys
import numpy as np
sys.modules["fla"] = None  # transformers' torch paths, as on a machine without CUDA
sys.path.insert(0, sys.argv[1])
import test_image_input as t
path, ids, images, new = json.load(sys.stdin)
pil = [t.PIL.fromarray(np.array(i, dtype=np.uint8)) for i in images]
print(json.dumps(t.hf_generate(path, ids, pil, new)))
"""


def hf_generate(path: str, ids: list[int], images: list, new: int) -> list[int]:
    """transformers' greedy tokens, its own image processor's pixels, fp32 on CPU. On a CUDA
    machine transformers binds FLA's CUDA-only kernels at import, so it runs in a subprocess
    that hides FLA."""
    if torch.cuda.is_available():
        import subprocess
        import sys

        done = subprocess.run(
            [sys.executable, "-c", _HF_IN_SUBPROCESS, os.path.dirname(os.path.abspath(__file__))],
            input=json.dumps([path, ids, [np.asarray(i.convert("RGB")).tolist() for i in images], new]),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    import transformers as T
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = T.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = Qwen2VLImageProcessorPil(**processor_config(path))
    feats = proc(images, return_tensors="pt")
    grid = feats["image_grid_thw"]
    expanded: list[int] = []
    sizes = iter((grid.prod(-1) // 4).tolist())
    for t in ids:
        expanded.extend([t] * next(sizes) if t == IMAGE else [t])
    x = torch.tensor([expanded])
    out = model.generate(
        x, attention_mask=torch.ones_like(x), pixel_values=feats["pixel_values"], image_grid_thw=grid,
        mm_token_type_ids=(x == IMAGE).int(), max_new_tokens=new, min_new_tokens=new, do_sample=False,
    )  # fmt: skip
    return out[0, x.shape[1] :].tolist()


def prompt(n_before: int, n_images: int, n_after: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 140, (n,), generator=g).tolist()  # noqa: E731
    ids = text(n_before)
    for _ in range(n_images):
        ids += [START, IMAGE, END] + text(3)
    return ids + text(n_after)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def test_processor_matches_transformers(checkpoint) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from deltaserve.models.vision.processor import ImageProcessor

    ours = ImageProcessor.from_checkpoint(checkpoint, None)
    imgs = [image(1, (37, 21)), image(2, (8, 8)), image(3, (200, 90))]  # rounded, grown, shrunk
    # transparency is laid over white, as transformers reads it: RGBA, grey with alpha, a palette
    rng = np.random.default_rng(4)
    rgba = PIL.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8), "RGBA")
    imgs += [rgba, rgba.convert("LA"), rgba.convert("RGB").convert("P", palette=PIL.Palette.ADAPTIVE)]
    imgs[-1].info["transparency"] = 0
    got = ours(imgs)
    want = Qwen2VLImageProcessorPil(**processor_config(checkpoint))(imgs, return_tensors="pt")
    assert got.grids == [tuple(g) for g in want["image_grid_thw"].tolist()]
    torch.testing.assert_close(got.pixel_values, want["pixel_values"].float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk", [512, 16])
def test_images_match_transformers(checkpoint, chunk: int) -> None:
    """One and two images, text before and after; chunk 16 splits images across prefill steps."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", chunked_prefill_size=chunk)
    cases = [
        (prompt(5, 1, 7, seed=1), [image(1, (24, 16))]),
        (prompt(2, 2, 4, seed=2), [image(2, (40, 32)), image(3, (16, 16))]),
        (prompt(0, 1, 1, seed=3), [image(4, (32, 24))]),
    ]
    outs = llm.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} for ids, imgs in cases], GREEDY
    )
    for out, (ids, imgs) in zip(outs, cases):
        assert out.outputs[0].token_ids == hf_generate(checkpoint, ids, imgs, NEW)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_prefix_cache_tells_images_apart(checkpoint) -> None:
    """The same prompt with another image after a cached run is not served from the first
    image's cache; the same image again is, and gives the same tokens."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", page_size=4)
    ids = prompt(9, 1, 9, seed=4)
    a, b = solid(0, (32, 32)), solid(255, (32, 32))
    first = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, GREEDY)[0]
    other = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b}}, GREEDY)[0]
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, GREEDY)[0]
    assert other.outputs[0].token_ids == hf_generate(checkpoint, ids, [b], NEW)
    assert other.outputs[0].token_ids != first.outputs[0].token_ids  # the image mattered
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens <= 12  # at most the text before the image
    assert again.num_cached_tokens > len(ids)  # past the image


def test_n_choices_of_an_image_prompt_start_from_its_warm_up(checkpoint) -> None:
    """A prompt with an image sampled n > 1 times is prefilled once first, its image read, so the
    choices start from the cache past the image (the warm-up left images out: each choice
    prefilled the whole prompt); each choice gives the tokens of the prompt alone."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", page_size=4)
    ids = prompt(9, 1, 9, seed=5)
    img = solid(100, (32, 32))
    params = SamplingParams(n=3, top_k=1, max_tokens=NEW, ignore_eos=True)  # n greedy choices
    (out,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, params)
    assert out.num_cached_tokens > len(ids)  # past the image
    want = hf_generate(checkpoint, ids, [img], NEW)
    assert [c.token_ids for c in out.outputs] == [want] * 3
    # an image last: the prompt less its last token would cut it, and is not warmed
    last = prompt(9, 0, 0, seed=6) + [START, IMAGE]
    (out,) = llm.generate({"prompt_token_ids": last, "multi_modal_data": {"image": img}}, params)
    assert [c.token_ids for c in out.outputs] == [hf_generate(checkpoint, last, [img], NEW)] * 3


def test_text_only_prompt_on_a_vision_checkpoint_matches_transformers(checkpoint, hf_reference) -> None:
    llm = LLM(checkpoint, dtype="float32", device="cpu")
    ids = prompt(20, 0, 0, seed=5)
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_reference(checkpoint, [ids], NEW)[0]


def test_bad_image_prompts_are_refused(checkpoint) -> None:
    llm = LLM(checkpoint, dtype="float32", device="cpu")
    ids = prompt(3, 1, 3, seed=6)
    with pytest.raises(ValueError, match="2 image placeholders for 1 image"):
        llm.generate(
            {"prompt_token_ids": ids + [IMAGE], "multi_modal_data": {"image": image(7, (16, 16))}}, GREEDY
        )
    with pytest.raises(ValueError, match="takes images only"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": [image(7, (16, 16))]}}, GREEDY)
    text_only = LLM(checkpoint, dtype="float32", device="cpu", language_model_only=True)
    assert text_only.engine.runner.vision is None
    with pytest.raises(ValueError, match="--language-model-only"):
        text_only.generate(
            {"prompt_token_ids": ids, "multi_modal_data": {"image": image(7, (16, 16))}}, GREEDY
        )
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_chat_reads_image_url_parts(checkpoint) -> None:
    """LLM.chat with an image_url part (a data URL) is generate() with that image."""
    import base64
    import io

    llm = LLM(checkpoint, dtype="float32", device="cpu", tokenizer=f"{checkpoint}/tokenizer")
    img = solid(255, (24, 24))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "w5 w6"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    chat = llm.chat(messages, GREEDY)[0]
    ids = llm.tokenizer.encode(chat.prompt, add_special_tokens=False)
    assert ids.count(IMAGE) == 1  # the template's one placeholder, expanded by the engine
    direct = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, GREEDY)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert chat.prompt_token_ids == direct.prompt_token_ids and len(chat.prompt_token_ids) == len(ids) + 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_images_on_cuda_match_transformers(vision_builder, tmp_path) -> None:
    """The CUDA path (the tower, the fused q/k norm then the 3-D rotation, decode graphs past the
    image), fp32, at the kernels' head sizes: transformers' tokens."""
    path = vision_builder(
        str(tmp_path), hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
    )
    llm = LLM(path, dtype="float32", device="cuda", chunked_prefill_size=16, max_running_requests=8)
    cases = [
        (prompt(5, 1, 7, seed=1), [image(1, (24, 16))]),
        (prompt(2, 2, 4, seed=2), [image(2, (40, 32)), image(3, (16, 16))]),
        (prompt(9, 1, 9, seed=4), [solid(0, (32, 32))]),
        (prompt(9, 1, 9, seed=4), [solid(255, (32, 32))]),
    ]
    outs = llm.generate([{"prompt_token_ids": i, "multi_modal_data": {"image": m}} for i, m in cases], GREEDY)
    same = sum(o.outputs[0].token_ids == hf_generate(path, i, m, NEW) for o, (i, m) in zip(outs, cases))
    print(f"images, fp32 on CUDA: {same}/{len(cases)} prompts identical to transformers over {NEW} tokens")
    assert same >= len(cases) - 1
    assert llm.engine.runner.graph_runner is not None and llm.engine.runner.graph_runner.decode.replays > 0
