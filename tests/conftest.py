import os
import sys

import torch

# Tests run on 2 cores alongside forked worlds: one compute thread keeps them from fighting.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
