"""
What the top-level scripts (train.py, sample.py, analyze.py, eval.py, prepare_data.py) are built from,
beside model.py's math, in three folders that import model.py and never a script:

    attention/   the model's family: the rivals, decoding fast, conversion, head diversity
    training/    training's machinery: flags, device and precision, data, recipe, Muon, parallelism,
                 the files a run writes
    evaluation/  the downstream tasks, and how runs are labelled wherever they are shown together
"""
