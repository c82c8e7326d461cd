#!/usr/bin/env bash
# The measurements behind docs/results/gpu.md, in one call on a lent GPU machine (repository root).
#   OUT=DIR bash docs/results/gpu/run.sh          # the full sizes (DiT-B/2 batch 64, ViT-S batch 256, bf16)
#   SMOKE=1 OUT=DIR bash docs/results/gpu/run.sh  # tiny sizes, any machine: checks that every step runs
# Each step has its own time limit and a failed step does not stop the next; every log and JSON lands
# in $OUT/gpu (packed as $OUT/gpu.tar.gz at the end), the step summary in $OUT/summary.txt.
# Python packages the GPU image lacks travel in .gpu/site (PYTHONPATH), copied from our venv's site-packages:
# hydra, omegaconf, antlr4, submitit, hydra_plugins/hydra_submitit_launcher, torch_fidelity, timm and diffusers
# (without diffusers/pipelines), with their *.dist-info folders; all pure Python, 28 MB.
set -u
OUT=${OUT:?set OUT to a folder for the results}
SMOKE=${SMOKE:-0}
R=$OUT/gpu
mkdir -p "$R"
export PYTHONPATH=$PWD:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
SUMMARY=$OUT/summary.txt
WORK=${TMPDIR:-/tmp}/visattn-gpu
rm -rf "$WORK" && mkdir -p "$WORK"

if [ "$SMOKE" = 1 ]; then
  VIT_BATCH=4 DIT_BATCH=2 CLS_IMAGES=16 CLS_EPOCHS=2 DIT_STEPS=4 DIT_LOG=2 SAMPLES=4 REPEATS=2 LOG_EVERY=2
  DIT_KW="--dit-kwargs depth=2 input_size=8"; VIT_KW="--vit-kwargs depth=2 img_size=32"
  SHAPES="4,17,96,8"; BENCH_BATCH=2; DEVICE=auto; CLS_SIZE=32; DIT_SIZE=64; DIT_DEPTH="+dit.overrides.depth=2"
  VAE_KW="block_out_channels=[8,8,8,8] layers_per_block=1 norm_num_groups=8"
  STUDY_CELLS="mha moh-50"; STUDY_BATCH=8; PRESETS="vit_digits dit_s2"
else
  VIT_BATCH=256 DIT_BATCH=64 CLS_IMAGES=25600 CLS_EPOCHS=3 DIT_STEPS=600 DIT_LOG=100 SAMPLES=512 REPEATS=10 LOG_EVERY=10
  DIT_KW=""; VIT_KW=""
  SHAPES="32,197,384,6 16,256,768,12 256,17,96,8 256,49,64,8"; BENCH_BATCH=64; DEVICE=cuda; CLS_SIZE=224; DIT_SIZE=256
  DIT_DEPTH=""; VAE_KW=""; STUDY_CELLS="mha moh-50 moh-75 moh-90 moh-50-head-choice moh-75-head-choice"
  STUDY_BATCH=256; PRESETS="vit_small dit_b2"
fi

source "$(dirname "$0")/steps.sh"

device_info

# 1. Issue 31: our training step against a bare PyTorch loop, both tasks, bf16.
step loop 150 $PY -m visattn.bench loop --device $DEVICE --dtypes bf16 --vit-batch $VIT_BATCH --dit DiT-B/2 \
  --dit-batch $DIT_BATCH $DIT_KW $VIT_KW --repeats $REPEATS --warmup 2 --log-every $LOG_EVERY --out "$R/loop.json"

# 2. Issue 31: short real trainings through the entry points (DeiT-S recipe on random images; DiT-B/2 on random
# latents: the GPU's side of a run, without a dataset's decoding).
step train_cls 150 $PY train_cls.py experiment=deit_s attn=mha data=fake data.image_size=$CLS_SIZE \
  data.train_size=$CLS_IMAGES data.val_size=$((CLS_IMAGES / 10)) data.num_workers=12 train.epochs=$CLS_EPOCHS \
  sched.warmup_epochs=0 train.batch_size=$VIT_BATCH train.amp=bf16 train.progress=false \
  hydra.run.dir="$R/cls_vit_s"
$PY - "$WORK/latents" "$SMOKE" <<'PYEOF' >"$R/latents.log" 2>&1
import sys, torch
from visattn.data.latents import write_latent_cache
g = torch.Generator().manual_seed(0)
side = 8 if sys.argv[2] == "1" else 32
def batches():
    for _ in range(4):
        yield torch.zeros(256, 3, 8, 8), torch.randint(0, 1000, (256,), generator=g)
def encode(x):
    mean = torch.randn(x.shape[0], 4, side, side, generator=g)
    return mean, torch.full_like(mean, 0.1)
write_latent_cache(sys.argv[1], batches(), encode, 0.18215, meta={"note": "random latents (throughput only)"})
PYEOF
DIT_ARGS="dit=b_2 $DIT_DEPTH vae=sd data=fake data.image_size=$DIT_SIZE data.latents=$WORK/latents eval.enabled=false
  train.batch_size=$DIT_BATCH train.amp=bf16 train.log_every=$DIT_LOG train.ckpt_every=100000 train.progress=false"
step train_dit 120 $PY train_dit.py $DIT_ARGS train.steps=$DIT_STEPS hydra.run.dir="$R/dit_b2"

# 3. Issue 31 item 4: sampling the trained DiT-B/2 (DDIM 25, cfg 1.5) with a randomly initialised SD VAE of the
# released architecture (diffusers' AutoencoderKL defaults + sd-vae-ft-ema's config), fp32 vs bf16 vs compiled.
$PY - "$WORK/vae" "$VAE_KW" <<'PYEOF' >"$R/vae.log" 2>&1
import sys
from diffusers import AutoencoderKL
kw = dict(kv.split("=") for kv in sys.argv[2].split()) if sys.argv[2] else {}
kw = {k: eval(v) for k, v in kw.items()}
sd = dict(in_channels=3, out_channels=3, latent_channels=4, sample_size=256,
          down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
          block_out_channels=[128, 256, 512, 512], layers_per_block=2)
AutoencoderKL(**{**sd, **kw}).save_pretrained(sys.argv[1])
PYEOF
for amp in none bf16; do
  step sample_$amp 90 $PY train_dit.py mode=sample ckpt="$R/dit_b2" vae=sd vae.path="$WORK/vae" \
    sample.num_samples=$SAMPLES sample.sampler=ddim sample.steps=ddim25 sample.cfg_scale=1.5 sample.amp=$amp \
    sample.batch_size=256 train.progress=false hydra.run.dir="$WORK/sample_$amp"
  cp "$WORK/sample_$amp/results.json" "$R/sample_$amp.json" 2>/dev/null
done

# 4. Issue 32: MoH's paths and whole models on the GPU, bf16 and fp32 (TF32 off: the benches set no flags).
step paths 120 $PY -m visattn.bench paths --device $DEVICE --shapes $SHAPES --budgets 0.5 0.75 0.9 \
  --dtypes bf16 fp32 --repeats $REPEATS --out "$R/paths.json"
step models 120 $PY -m visattn.bench model --device $DEVICE --presets $PRESETS --batch $BENCH_BATCH \
  --dtypes bf16 --repeats $REPEATS --out "$R/models.json"
step study 90 $PY -m visattn.bench study --device $DEVICE --cells $STUDY_CELLS --batch $STUDY_BATCH --dtypes bf16 fp32 \
  --repeats $REPEATS --out "$R/study.json"


# 5. Issue 31 item 2/4: torch.compile on the GPU, last (its compile time is the longest step).
step train_dit_compiled 200 $PY train_dit.py $DIT_ARGS train.steps=$DIT_STEPS train.compile=true \
  hydra.run.dir="$R/dit_b2_compiled"
step sample_compiled 150 $PY train_dit.py mode=sample ckpt="$R/dit_b2" vae=sd vae.path="$WORK/vae" \
  sample.num_samples=$SAMPLES sample.sampler=ddim sample.steps=ddim25 sample.cfg_scale=1.5 sample.amp=bf16 \
  sample.compile=true sample.batch_size=256 train.progress=false hydra.run.dir="$WORK/sample_compiled"
cp "$WORK/sample_compiled/results.json" "$R/sample_compiled.json" 2>/dev/null
tar -czf "$OUT/gpu.tar.gz" --exclude=checkpoints --exclude=tb --exclude="*.safetensors" --exclude="*.npz" -C "$OUT" gpu
