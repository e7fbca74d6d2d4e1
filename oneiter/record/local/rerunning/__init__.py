"""`record/local/rerunning/`: the parts of one call's rerun (`rerun.py`'s `Rerunner` puts them together).

- `site.py`        where and in which precision a rerun runs (`Site`), its Monte Carlo perturbation, its `RunResult`
- `isolation.py`   a rerun kept apart from the live iteration: modes, buffers, RNG states, FSDP2 hooks, autocast
- `forcing.py`     the forced children: the source's recorded outputs forward, its recorded gradients backward
- `gradients.py`   the gradients backward is seeded with: each output's from outside the call, the call's own part
- `strides.py`     tensors laid out as the live call's were (strides, storage offset)
- `rerun_metrics.py` the numbers of a row: a rerun's tensor against its reference (`tensor_stats`, `rel_l2`)
"""
