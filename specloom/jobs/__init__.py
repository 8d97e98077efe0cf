"""The jobs above the drafters: `specloom train` (train.py: the loop; each kind's trainer comes from its
record) and `specloom data` (data.py: self-distillation through the batch scheduler). They may import drafters/,
training/ (the toolkit), engine and scheduler; nothing below imports them (only cli/)."""
