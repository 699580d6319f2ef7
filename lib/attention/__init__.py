"""The model's family: the rivals (rivals.py), decoding fast (decode.py), one variant's weights to
another's (convert.py), and the heads' diversity (diversity.py), each built on model.py."""
