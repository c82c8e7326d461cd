# Sourced by the GPU scripts beside it (run.sh, moh.sh), with OUT, R (a folder in $OUT), PY and SUMMARY set.

step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log to $R/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return ;; esac  # ONLY="a b": those steps alone
  local t0=$SECONDS
  timeout "$limit" "$@" >"$R/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
  local folder
  folder=$(basename "$R")
  # what finished comes back even if the call is cut
  tar -czf "$OUT/$folder.tar.gz" --exclude=checkpoints --exclude=tb --exclude="*.safetensors" --exclude="*.npz" \
    -C "$OUT" "$folder"
}

device_info() {  # the GPU, its driver, torch, triton and the host CPU into $R/device.txt and the summary
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
    $PY -c "import torch, timm, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm',
timm.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    grep -m1 'model name' /proc/cpuinfo; nproc
  } >"$R/device.txt" 2>&1
  cat "$R/device.txt" >"$SUMMARY"
}
