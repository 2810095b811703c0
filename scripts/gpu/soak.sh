# soak: 100,000 decode steps of the default model (compiled + graph replay, the caches filled and restarted every
# ~200 steps), twice with the same seed: flat device memory, no recompile, no NaN, identical ids.
step soak 500 $PY scripts/soak.py --steps 100000
note "  $(grep -hsE '^run |^soak' "$LOGS/soak.log" | cut -c1-400 | tr '\n' ' ')"
