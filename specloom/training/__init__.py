"""The training toolkit the kinds' trainers use (drafters/<kind>/trainer.py): the trainer base, losses, the
learning-rate schedule and the optimizer step (common.py), the `specloom train` options kinds share (options.py),
compact data shards (shards.py), the dataset with recomputed hidden states (dataset.py), torchrun sharding
(distributed.py). The jobs that drive it (`specloom train`, `specloom data`) are in jobs/.

May import: models/, loading/, kv and the other currencies below the drafters; never drafters/ (it sits below
them), the engine, serving/, bench/ or jobs/."""
