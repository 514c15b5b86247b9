"""`phalanx demo`: fault-tolerant training of a small Llama-style model on one machine,
through a failure every 15 seconds, with a report of what the job achieved.

- `phalanx.demo.train`: the training script (a plain phalanx training loop);
- `phalanx.demo.model`: the model; `phalanx.demo.report`: the numbers, from the step log;
- `phalanx.demo.job`: the command, a launcher that watches its groups.
"""
