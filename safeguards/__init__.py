"""The safeguards the four scripts apply around their lessons, a module per concern. Each script
calls them where a reader sees it (a check before a step, a `with` around a save); the package
imports no script: a script hands it values.

    launch       starting the processes and the process group, signals, the lock-step check
    errors       one error line agreed across ranks, divergence
    flags        the flags every script has, argparse's one-line refusals
    checkpoints  free space, the folder lock, markers, the resume line, asynchronous saves
    report       the run's report and step log (tokens/s, TFLOP/s, MFU, memory, --metrics-json)
    describe     what FSDP built, printed and checked
    fsdp2_checks, t5_checks, mnist_checks   each script's flag and input checks
    plan, fsdp2_plan, t5_plan                --plan: each rank's memory, predicted
    replica_groups                           torchft's replica groups (--fault-tolerance)
    workarounds  the labelled workarounds of torch and transformers, to prune as versions move
"""
