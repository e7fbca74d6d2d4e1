"""`record/local/probing/`: `LocalProbe`, what both probes share (`probe.py` holds the two modes), floor by floor;
each floor's class extends the one below and uses only what lies below it.

- `sources.py`      where a probe reads its tensors (`Cached`, `MemorySource`) and what it sums over calls (`Sums`)
- `noise.py`        a rerun's noise from other reruns: against a high run, Monte Carlo spread, overflow, roundoff
- `state.py`        `ProbeState`: the probe's settings and gatherings, and what each mode decides (abstract)
- `bounds.py`       `NoiseBounds`: a calibrated noise checked against what the precision can produce
- `calibration.py`  `Calibration`: each calibrated call's expected noise (CPU or device; float32, Monte Carlo)
- `summed_rows.py`  `SummedValues`: parameter gradients summed over calls, and the noise of any summed value
- `base.py`         `LocalProbe`: the entry points the capture and the recorder call, and each call's probe
"""
