"""What an extraction is before any engine starts: the spec checked against the model and the
dataset (``plan``). The extract, plan and assemble steps, and validation's fresh tokenization, all
start from the same plan."""
