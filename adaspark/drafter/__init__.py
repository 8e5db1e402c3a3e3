"""The DSpark block drafter: model (model.py), runtime cache and draft forward (runtime.py),
checkpoints (checkpoint.py, loading.py), training data (data.py, shards.py), draft vocabulary
(vocab.py), loss and training (loss.py, train.py), temperature scaling (calibrate.py),
evaluation (evaluate.py) and the train-drafter pipeline (pipeline.py)."""
