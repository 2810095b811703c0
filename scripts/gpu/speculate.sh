# speculate: the default model with --speculate K (compiled + CUDA graph per bucket) for each K in SPECULATE_KS:
# tokens/s, tokens per step and acceptance per draft position, against the plain run (K = 0) of the same prompt.
# SPECULATE_ARGS: more arguments of every speculative run (K > 0 here, and the preset passes below), e.g.
# "--draft-head nvfp4".
# The completion's text from a generate log: without the engine's [dsv4] lines, the loaders' progress bars (their
# rates differ run to run; tqdm writes them after a carriage return) and Python's warning lines.
completion() { grep -vsE '^\[dsv4\]|^.?(loading|NVFP4) .*\||^\S+:[0-9]+: \w*Warning:|^\s+warnings\.warn\(' "$1"; }
for k in ${SPECULATE_KS-0 1 2 3}; do
  extra=(); [ "$k" != 0 ] && extra=(${SPECULATE_ARGS:-})
  step "speculate_$k" 200 $PY -m dsv4_model generate --prompt "def fibonacci(n):" --max-new-tokens 128 --speculate $k \
    ${extra[@]+"${extra[@]}"}
  note "  $(grep -hsE 'done in|tokens/s|speculation:' "$LOGS/speculate_$k.log" | tr '\n' ' ')"
  completion "$LOGS/speculate_$k.log" | md5sum | sed "s/^/  text md5 K=$k: /" | tee -a "$SUMMARY"
done
# SPECULATE_DRAFTER_DIR (empty: skipped): the same prompt with a trained DSpark directory (--drafter DIR,
# scripts/train_dspark.py's output) for each K in SPECULATE_DRAFTER_KS (1 3): its text must match K = 0's.
for k in ${SPECULATE_DRAFTER_DIR:+${SPECULATE_DRAFTER_KS:-1 3}}; do
  step "speculate_drafter_$k" 200 $PY -m dsv4_model generate --prompt "def fibonacci(n):" --max-new-tokens 128 \
    --speculate $k --drafter "$SPECULATE_DRAFTER_DIR"
  note "  $(grep -hsE 'done in|tokens/s|speculation:' "$LOGS/speculate_drafter_$k.log" | tr '\n' ' ')"
  completion "$LOGS/speculate_drafter_$k.log" | md5sum | sed "s/^/  text md5 drafter K=$k: /" | tee -a "$SUMMARY"
done
# Then the cost of a speculative pass at V4-Flash widths: SPECULATE_PRESET (flash2; empty: skipped; NAME:N gives a
# preset N routed experts, e.g. flash43:96 on an 80 GB card) with a random drafter of each of SPECULATE_DRAFTERS
# (mtp dspark: bench/common.py with_drafter), each K in SPECULATE_PRESET_KS (3) in one process per drafter (one build,
# one static batch), at SPECULATE_PRESET_C (1,8) through the scheduler: ms per pass against the plain static batch's
# step (the 1.15x goal).
preset_spec=${SPECULATE_PRESET-flash2}
preset=${preset_spec%%:*}; preset_experts=(); [[ $preset_spec == *:* ]] && preset_experts=(--experts "${preset_spec#*:}")
if [ -n "$preset" ]; then
  ks=$(echo ${SPECULATE_PRESET_KS:-3} | tr ' ' ','); nk=$(echo ${SPECULATE_PRESET_KS:-3} | wc -w)
  for d in ${SPECULATE_DRAFTERS:-mtp dspark}; do
    step "speculate_${preset}_${d}_${ks//,/_}" $(( 200 + 200 * nk )) $PY bench/bench_continuous.py --model "$preset" \
      ${preset_experts[@]+"${preset_experts[@]}"} --concurrency "${SPECULATE_PRESET_C:-1,8}" \
      --prompt-len 128 --max-tokens 64 --requests-per-row 2 --speculate "$ks" --drafter "$d" ${SPECULATE_ARGS:-}
    [ -n "$DRY" ] || grep -hsE "^ +[0-9]+ +eager|steady state" "$LOGS/speculate_${preset}_${d}_${ks//,/_}.log" \
      | sed 's/^/  /' | tee -a "$SUMMARY"
  done
fi
# The confidence cut's saving: flash2's random DSpark at K = 5 with blocks cut before a draft predicted below
# SPECULATE_CUT (0.5; empty: skipped), against the uncut K = 5 run of the same bench (docs/dspark.md).
if [ -n "$preset" ] && [ -n "${SPECULATE_CUT-0.5}" ]; then
  step "speculate_${preset}_dspark_cut" 400 $PY bench/bench_continuous.py --model "$preset" --concurrency 1,8 \
    --prompt-len 128 --max-tokens 64 --requests-per-row 2 --speculate 5 --drafter dspark --dspark-cut "${SPECULATE_CUT-0.5}"
  step "speculate_${preset}_dspark_5" 400 $PY bench/bench_continuous.py --model "$preset" --concurrency 1,8 \
    --prompt-len 128 --max-tokens 64 --requests-per-row 2 --speculate 5 --drafter dspark
  [ -n "$DRY" ] || grep -hsE "^ +[0-9]+ +eager|steady state|speculation:" "$LOGS/speculate_${preset}_dspark_cut.log" \
    "$LOGS/speculate_${preset}_dspark_5.log" | sed 's/^/  /' | tee -a "$SUMMARY"
fi
# SPECULATE_PROFILE (empty: skipped): NAME[:N] presets whose plain step and K = 1 pass bench/profile_step.py breaks
# down by kernel, with each of SPECULATE_PROFILE_DRAFTERS (default mtp; dspark too) as a random drafter
# (SPECULATE_ARGS, e.g. "--draft-head nvfp4", passed on): issues #31 / #51's where.
for spec in ${SPECULATE_PROFILE:-}; do
  m=${spec%%:*}; ex=(); [[ $spec == *:* ]] && ex=(--experts "${spec#*:}")
  for d in ${SPECULATE_PROFILE_DRAFTERS:-mtp}; do
    step "profile_step_${m}_$d" 300 $PY bench/profile_step.py --model "$m" ${ex[@]+"${ex[@]}"} --speculate 1 \
      --drafter "$d" ${SPECULATE_ARGS:-}
    [ -n "$DRY" ] || grep -hsA12 "^## " "$LOGS/profile_step_${m}_$d.log" | sed 's/^/  /' | tee -a "$SUMMARY"
  done
done
