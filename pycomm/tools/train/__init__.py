"""pycomm-train: data, models, the training loop, metrics and checkpoints.

Run ``pycomm-run -np 4 pycomm-train --algorithm ssgd --dataset digits --model mlp --epochs 5``
(or ``python -m pycomm.tools.train``); ``--help`` lists the options.
"""
