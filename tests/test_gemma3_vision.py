"""Gemma 3 with images (use_multimodal=true): SigLIP, the projector and the merge, on both backends.

The reference is a tiny random `Gemma3ForConditionalGeneration` saved with
save_pretrained: a 7-layer Gemma 3 language model whose window (2) is shorter
than an image's 4 soft tokens, so the image tokens' two-way attention within
the window is seen, and a 2-block SigLIP over 16x16 images of 4x4 patches,
pooled 2x2. Row 0 holds two images, row 1 one (its second image is padding,
`image_masks`).
"""

import base64
import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge import cli  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf, images  # noqa: E402
from maxbridge.models import dispatch  # noqa: E402
from maxbridge.ops import vision  # noqa: E402
from maxbridge.serving import chat_content  # noqa: E402
from maxbridge.serving import engine as serving_engine  # noqa: E402
from maxbridge.training import recipe  # noqa: E402
import served  # noqa: E402
from conftest import FLAG_COMBINATIONS, flag_id  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import max_diff, randomize  # noqa: E402

FIELDS_MD = Path(hf.__file__).parent / "FIELDS.md"
HIDDEN, IMAGE, TOKENS_PER_IMAGE = 64, 16, 4
BOI, EOI, IMAGE_TOKEN = 253, 254, 255
TEXT = dict(
    hidden_size=HIDDEN,
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    num_hidden_layers=7,
    sliding_window=2,
    query_pre_attn_scalar=24,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    },
    rms_norm_eps=1e-6,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE,
    patch_size=4,
    layer_norm_eps=1e-5,
    vision_use_head=False,
)


def _row(*pieces) -> list[int]:
  """Text ids and "img" markers -> ids, each image as boi, its soft tokens, eoi."""
  ids = []
  for piece in pieces:
    ids += [BOI, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, EOI] if piece == "img" else [piece]
  return ids


TOKENS = np.array(
    [
        _row(2, 7, "img", 9, "img", 11, 12),
        _row(3, "img", 20, 21, 22, 23, 24, 25, 26, 27, 28, 29),
    ],
    np.int32,
)
IMAGES = np.random.default_rng(0).standard_normal((2, 2, IMAGE, IMAGE, 3)).astype(np.float32)
IMAGES[1, 1] = 0.0
MASKS = np.array([[True, True], [True, False]])
INPUT = vision.MultimodalInput(jnp.asarray(IMAGES), jnp.asarray(MASKS))


def torch_logits(model, tokens=TOKENS, images=IMAGES, masks=MASKS):
  pixels = torch.tensor(images[masks].transpose(0, 3, 1, 2).copy())  # the real images, row by row, NCHW
  ids = torch.tensor(tokens, dtype=torch.long)
  with torch.no_grad():
    return model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE_TOKEN).long()).logits.numpy()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.Gemma3Config(
      text_config=TEXT,
      vision_config=VISION,
      mm_tokens_per_image=TOKENS_PER_IMAGE,
      boi_token_index=BOI,
      eoi_token_index=EOI,
      image_token_index=IMAGE_TOKEN,
  )
  model = transformers.Gemma3ForConditionalGeneration(config).eval()
  randomize(model)
  with torch.no_grad():  # a constant buffer (sqrt(hidden_size)), not a weight: randomize drew it too
    model.model.language_model.embed_tokens.embed_scale.fill_(HIDDEN**0.5)
  folder = tmp_path_factory.mktemp("gemma3_vision") / "hf"
  model.save_pretrained(folder)
  logits = torch_logits(model)
  assert np.std(logits) > 0.1, "logits too flat to tell a wrong mapping from a right one"
  with torch.no_grad():
    text_logits = model(input_ids=torch.tensor(TOKENS[:, :3], dtype=torch.long)).logits.numpy()
  return model, folder, logits, text_logits


@pytest.fixture(scope="module")
def loaded(reference):
  """The reference folder read on each backend."""
  return {backend: mb.from_pretrained(reference[1], backend=backend) for backend in ("linen", "nnx")}


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_logits_with_images_match_transformers(loaded, reference, backend):
  model = loaded[backend]
  assert model.config.use_multimodal and model.config.vision_output_length == TOKENS_PER_IMAGE
  assert max_diff(model.logits(TOKENS, multimodal_input=INPUT), reference[2]) <= 1e-4


def test_image_tokens_attend_both_ways_within_their_image(loaded):
  """A later soft token of an image changes what the image's earlier tokens compute (never causal)."""
  model = loaded["linen"]
  images = IMAGES.copy()
  before = model.logits(TOKENS, multimodal_input=INPUT)
  # Row 1's image shifted by one patch: every soft token changes, the first one's logits with them.
  images[1, 0] = np.roll(images[1, 0], 4, axis=0)
  after = model.logits(TOKENS, multimodal_input=vision.MultimodalInput(jnp.asarray(images), jnp.asarray(MASKS)))
  first = 2  # row 1: [3, boi, img, ...]
  assert max_diff(before[1, first], after[1, first]) > 1e-3
  assert max_diff(before[:, :first], after[:, :first]) == 0.0  # nothing before the image sees it


@pytest.fixture(scope="module")
def text_only(reference):
  """The reference folder's language model alone (use_multimodal=false)."""
  return mb.from_pretrained(reference[1], backend="nnx", use_multimodal=False)


def test_text_only_logits_are_todays(loaded, text_only, reference):
  """Without images a multimodal model computes exactly what the text-only model of the same weights does."""
  assert "vision_encoder" not in text_only.params() and not text_only.config.use_multimodal
  tokens = TOKENS[:, :3]
  np.testing.assert_array_equal(np.asarray(loaded["nnx"].logits(tokens)), np.asarray(text_only.logits(tokens)))
  assert max_diff(text_only.logits(tokens), reference[3]) <= 1e-4


def test_a_text_only_read_of_a_multimodal_folder_says_what_it_drops(reference, caplog):
  with caplog.at_level("INFO"):
    config, params = hf.load_hf(reference[1], "use_multimodal=false")
  assert "left out" in caplog.text and "Gemma3ForConditionalGeneration" in caplog.text
  assert set(params) == {"decoder", "token_embedder"} and config.decoder_block == "gemma3"


def test_linen_and_nnx_agree_with_images_in_every_flag_combination(loaded):
  """The 8 (pure_nnx, enable_nnx, pure_nnx_decoder) mixes on the same weights give pure Linen's logits with images."""
  linen = loaded["linen"]
  want = linen.logits(TOKENS, multimodal_input=INPUT)
  for flags in FLAG_COMBINATIONS:
    model = dispatch.create_model(linen.config.replace(**dict(zip(dispatch.FLAGS, flags))), params=linen.params())
    assert max_diff(model.logits(TOKENS, multimodal_input=INPUT), want) <= 1e-6, flag_id(flags)


def test_export_gives_transformers_the_same_logits(loaded, reference, tmp_path):
  model = loaded["nnx"]
  folder = hf.save_hf(model.params(), model.config, tmp_path / "out")
  config = json.loads((folder / "config.json").read_text())
  assert config["architectures"] == ["Gemma3ForConditionalGeneration"] and config["model_type"] == "gemma3"
  exported = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
  assert max_diff(torch_logits(exported), reference[2]) <= 1e-4


def test_bad_images_are_named(loaded, text_only):
  model = loaded["nnx"]
  with pytest.raises(ValueError, match=r"images has shape \(2, 2, 8, 8, 3\).*image_size_for_vit"):
    model.logits(TOKENS, multimodal_input=vision.MultimodalInput(jnp.zeros((2, 2, 8, 8, 3))))
  with pytest.raises(ValueError, match="row 1 .* 4 image tokens .* 2 images"):
    model.logits(TOKENS, multimodal_input=vision.MultimodalInput(jnp.asarray(IMAGES)))  # row 1's padding image counted
  with pytest.raises(ValueError, match="without a vision tower"):
    text_only.logits(TOKENS, multimodal_input=INPUT)


def test_use_multimodal_needs_a_family_with_a_tower():
  with pytest.raises(ConfigError, match="use_multimodal=true: decoder_block=.llama2. has no vision tower.*'gemma3'"):
    mb.load_config("llama-tiny", use_multimodal=True)
  with pytest.raises(ConfigError, match="vision_output_length=3"):
    mb.load_config("gemma3-tiny", use_multimodal=True, vision_output_length=3)


def test_training_a_model_with_a_tower_is_refused_until_image_training_is_built():
  with pytest.raises(ConfigError, match="use_multimodal=true: training with images is not built yet"):
    recipe.create_trainer(mb.load_config("gemma3-tiny", use_multimodal=True))


def test_fields_md_names_every_vision_config_field_and_a_bad_activation_is_refused(reference):
  rows = set(re.findall(r"^\| vision_config\.(\w+) \|", FIELDS_MD.read_text(), re.M))
  fields = {f.name for f in dataclasses.fields(transformers.SiglipVisionConfig)}
  fields -= {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
  assert fields <= rows, f"FIELDS.md's gemma3 section does not classify vision_config.{sorted(fields - rows)}"
  raw = json.loads((reference[1] / "config.json").read_text())
  with pytest.raises(hf.HFError, match="hidden_act='gelu'"):
    hf.config_from_hf({**raw, "vision_config": {**raw["vision_config"], "hidden_act": "gelu"}})
  with pytest.raises(hf.HFError, match=r"vision_config.image_size=\[16, 8\]"):
    hf.config_from_hf({**raw, "vision_config": {**raw["vision_config"], "image_size": [16, 8]}})


# --- preprocessing, without a hub ---------------------------------------------------------------


def _png(path, seed: int, size=(23, 17)):
  from PIL import Image

  pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
  Image.fromarray(pixels).save(path)
  return path


def test_images_are_preprocessed_as_transformers_does_and_give_its_logits(loaded, reference, tmp_path):
  """A folder's preprocessor_config.json (its own mean and std) is read; two PNGs of another size -> the model's
  pixels, equal to Gemma3ImageProcessorPil's, and the logits with them equal transformers'."""
  from PIL import Image

  processor = transformers.Gemma3ImageProcessorPil(
      size={"height": IMAGE, "width": IMAGE}, image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.25]
  )
  processor.save_pretrained(tmp_path)
  files = [_png(tmp_path / "a.png", 1), _png(tmp_path / "b.png", 2, size=(9, 30))]
  ours = images.load_images(files, image_size=IMAGE, folder=tmp_path)
  want = processor([Image.open(f) for f in files], return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
  assert ours.shape == (2, IMAGE, IMAGE, 3) and max_diff(ours, want) <= 1e-6
  # Row 0 takes both images, row 1 the first (the shapes of INPUT: its compiled forward pass is reused).
  pixels = np.stack([ours, np.stack([ours[0], np.zeros_like(ours[1])])])
  got = loaded["linen"].logits(TOKENS, multimodal_input=vision.MultimodalInput(jnp.asarray(pixels), jnp.asarray(MASKS)))
  assert max_diff(got, torch_logits(reference[0], TOKENS, pixels, MASKS)) <= 1e-4
  # Without a preprocessor_config.json: Gemma3ImageProcessor's defaults at the tower's size.
  default = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE})
  want = default([Image.open(files[0])], return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
  assert max_diff(images.load_images(files[:1], image_size=IMAGE), want) <= 1e-6


def test_placeholders_expand_to_the_image_tokens():
  config = mb.load_config("gemma3-tiny", use_multimodal=True)
  text = images.expand_placeholders("a <start_of_image> b", config.image_placeholder, 2)
  assert text == "a \n\n<start_of_image><image_soft_token><image_soft_token><end_of_image>\n\n b"
  ids = images.expand_image_tokens([2, BOI, 9], boi=BOI, image=IMAGE_TOKEN, eoi=EOI, tokens_per_image=3)
  assert ids == [2, BOI, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, EOI, 9]


def test_a_file_that_is_not_an_image_and_pan_and_scan_are_named(tmp_path):
  (tmp_path / "x.png").write_text("not an image")
  with pytest.raises(images.ImageError, match="x.png is not an image"):
    images.load_images([tmp_path / "x.png"], image_size=IMAGE)
  with pytest.raises(images.ImageError, match="these bytes is not an image"):
    images.decode(b"\x00\x01")
  (tmp_path / images.PREPROCESSOR_FILE).write_text(json.dumps({"do_pan_and_scan": True}))
  with pytest.raises(images.ImageError, match="do_pan_and_scan=true"):
    images.load_images([_png(tmp_path / "a.png", 0)], image_size=IMAGE, folder=tmp_path)


# --- serving: a prefill with images ---------------------------------------------------------------


def transformers_continuation(model, prompt, pixels, new_tokens: int = 8) -> np.ndarray:
  ids = torch.tensor(prompt[None], dtype=torch.long)
  with torch.no_grad():
    return model.generate(
        input_ids=ids,
        pixel_values=torch.tensor(pixels.transpose(0, 3, 1, 2).copy()),
        token_type_ids=(ids == IMAGE_TOKEN).long(),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    ).numpy()[0, len(prompt) :]


def test_engine_continues_a_prompt_with_images_as_transformers_generates(loaded, reference):
  """8 greedy tokens after a prompt with one image, by mb.Engine's prefill and decode (`generate_continuation`), on
  Linen (the next test runs it on NNX, from `maxbridge generate --image`): transformers' generate's."""
  prompt, pixels = TOKENS[1], IMAGES[1, :1]
  model = loaded["linen"]
  config = model.config.replace(decode_sampling_strategy="greedy", max_prefill_predict_length=16)
  got = serving_engine.generate_continuation(config, model, prompt, 8, images=pixels)
  np.testing.assert_array_equal(np.asarray(got), transformers_continuation(reference[0], prompt, pixels))


def with_tokenizer(reference, folder: Path) -> Path:
  """The reference folder copied to `folder`, with a word-level tokenizer (w0..w252) that reads Gemma 3's image
  strings as boi, eoi and the image token, and a chat template that writes each message's content."""
  tokenizers = pytest.importorskip("tokenizers")
  shutil.copytree(reference[1], folder)
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(BOI)}, unk_token="w0"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  tokenizer.add_special_tokens(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])  # 253, 254, 255
  tokenizer.save(str(folder / "tokenizer.json"))
  template = "{% for m in messages %}{{ m.content }} {% endfor %}"
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  return folder


def test_generate_with_an_image_file_prints_transformers_continuation(reference, tmp_path, capsys):
  """`maxbridge generate --image`: the folder's tokenizer reads the expanded placeholder as boi, image tokens, eoi."""
  folder = with_tokenizer(reference, tmp_path / "with-tokenizer")
  image = _png(tmp_path / "cat.png", 3)
  words = " ".join(f"w{t}" for t in TOKENS[1, 7:])
  args = ["generate", str(folder), "--prompt", f"w3 <start_of_image> {words}", "--image", str(image)]
  assert cli.main([*args, "--max-new-tokens", "8", "--temperature", "0", "--backend", "nnx"]) == 0
  pixels = images.load_images([image], image_size=IMAGE)
  want = transformers_continuation(reference[0], TOKENS[1], pixels)
  assert all(t < BOI for t in want), "a special token would not be printed"
  assert capsys.readouterr().out.split()[-8:] == [f"w{t}" for t in want]
  # One placeholder, two images: named.
  assert cli.main([*args, "--image", str(image), "--backend", "nnx"]) == 2
  assert "1 image placeholders" in capsys.readouterr().err


def test_a_served_chat_with_an_image_part_continues_as_transformers_generates(reference, tmp_path):
  """`maxbridge serve` (NNX) driven by the official openai client: a user message of text, an image and text renders
  to TOKENS[1]'s ids, and n=2 greedy choices are transformers' 8 tokens after them, the image given as a data: URL
  or as a file under --allowed-local-media-path. A URL to fetch, a file outside that directory, bytes that are no
  image and an image of too many pixels are refused naming the part and why."""
  openai = pytest.importorskip("openai")
  from PIL import Image

  folder = with_tokenizer(reference, tmp_path / "served")
  media = tmp_path / "media"
  media.mkdir()
  png = _png(media / "cat.png", 5)

  def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()

  def message(url: str) -> list[dict]:
    words = " ".join(f"w{t}" for t in TOKENS[1, 7:])
    parts = [
        {"type": "text", "text": "w3"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": words},
    ]
    return [{"role": "user", "content": parts}]

  overrides = ["per_device_batch_size=2", "max_target_length=64", "max_prefill_predict_length=32"]
  server = served.Server(folder, "nnx", "--allowed-local-media-path", str(media), *overrides)
  try:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def chat(url: str, **kwargs):
      return client.chat.completions.create(model="served", messages=message(url), temperature=0, **kwargs)

    want = transformers_continuation(reference[0], TOKENS[1], images.load_images([png], image_size=IMAGE))
    assert all(t < BOI for t in want), "a special token would not be printed"
    reply = chat(data_url(png.read_bytes()), max_tokens=8, n=2)
    assert [choice.message.content.split() for choice in reply.choices] == [[f"w{t}" for t in want]] * 2
    assert reply.usage.prompt_tokens == len(TOKENS[1])
    assert chat(png.as_uri(), max_tokens=8).choices[0].message.content.split() == [f"w{t}" for t in want]
    outside = _png(tmp_path / "elsewhere.png", 6)
    Image.new("1", (9000, 8000)).save(media / "huge.png")  # 72 million pixels, a few kilobytes
    field = r"messages\.0\.content\.1\.image_url\.url"
    for url, why in (
        ("https://example.com/cat.png", "fetches nothing over the network"),
        (outside.as_uri(), "is outside the allowed directory"),
        ((media / ".." / "elsewhere.png").as_uri(), "is outside the allowed directory"),
        (data_url(b"not an image"), "not an image Pillow can read"),
        ((media / "huge.png").as_uri(), "9000x8000 pixels, more than"),
    ):
      with pytest.raises(openai.BadRequestError, match=f"{field}: .*{why}"):
        chat(url, max_tokens=2)
  finally:
    server.stop()
  with pytest.raises(ValueError, match="allowed-local-media-path .*missing: not a directory"):
    chat_content.Vision.of(
        mb.load_config("gemma3-tiny", use_multimodal=True), chat_content.ImageSources(None, media / "missing")
    )
