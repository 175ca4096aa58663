"""Training an EAGLE-3 draft on a finished dataset, and measuring it.

    recipe     speculators' training recipe: every option of its script as a field (unset: its default),
               resolved by speculators; its draft builder and TrainerConfig
    settings   DraftSettings: what a draft is trained with (speculators' options, the steps, the
               held-out split, the device)
    draft      train_draft: speculators' own Eagle3DraftModel, sampler, collate function and Trainer,
               fed from the packed shards through datagen.reader.for_speculators; the draft saved
               in speculators' format (what vLLM loads as an EAGLE-3 speculator) with its lineage
    agreement  measure_agreement: the draft's per-position top-1 agreement with the target's greedy
               next tokens on the held-out rows, and the acceptance length it implies
    spec_decode (vLLM) the acceptance length of real speculative decoding, where the engine runs EAGLE-3

Only these modules (and datagen.reader.for_speculators) import speculators.
"""
