"""The bundled trainer for depth-recurrent language models.

Kept free of heavy imports: `trainer.rundir` is read by rlmctl and the exporter without torch.
"""

__version__ = "0.1.0"
