--------------------------- MODULE TraceRuntime ---------------------------
(***************************************************************************)
(* Trace validation of logs of REAL runs: the connector's `trace_path` log *)
(* of vLLM's real Scheduler, the ranks and Mooncake (integration tests,    *)
(* the demo).  TraceData.tla (`Trace`) is written by conformance.runlog.   *)
(*                                                                         *)
(* Such a log holds the ledgers' events and the notices the connector's    *)
(* scheduler side sends (Preempt, Finish), but not vLLM's own scheduling   *)
(* (admissions, prefix-cache hits, block allocation, decode): those have no *)
(* counterpart in KVLedger's chunk-per-block request model.  So this spec   *)
(* checks the log against the model's job lifecycle: every ledger event is *)
(* the model's own action on the model's own state (OpenJob, ReceiveJob,   *)
(* DropNotice, DmaReadJob, PutJob, ReportJob, CollectTaken), with the       *)
(* request's generation, pinned blocks and partial tail (pinned last)     *)
(* taken from the EmitStore event instead of from the (unlogged)          *)
(* scheduler; and the observed values after each step (live sets,         *)
(* verdicts, ranks_left, pin counts) must equal the model's.  The model's *)
(* invariants on that part (ReportedOnce,                                 *)
(* BoundedPins, DmaReadsPinned, TypeOK) and its action properties          *)
(* (NoStaleEffect, LifecycleConforms) are checked on every step.  Offsets  *)
(* are not compared (the chunk ranges of a job are not in the log).        *)
(*                                                                         *)
(* Loads: a rank's Load event must give every attempted block an outcome   *)
(* (loaded or failed, not both), and its failed blocks and the blocks it   *)
(* hands the scheduler (HandleLoadErrors = take_errors) must match one to  *)
(* one over the run (either may come first: a block is reported the moment *)
(* its sub-batch fails, the Load event when the whole load is done).       *)
(*                                                                         *)
(* Load pins (S9 LoadsPinned): lpin maps each pinned load (numbered by the *)
(* normalizer in EmitLoad order) to its ranks_left; CollectLoad subtracts  *)
(* the reported ranks and drops a load at 0, with the logged counts equal  *)
(* to these; a rank's Load event (the rank finished writing the load) must  *)
(* name a load that is still pinned.                                       *)
(*                                                                         *)
(* Accepted when the whole log was matched and, if ExpectRest, the run     *)
(* ended at rest: every job released, every notice heard by every rank,    *)
(* every failed load block reported (see FullyMatched).                    *)
(***************************************************************************)
EXTENDS KVLedger, TraceData, Naturals, Sequences, FiniteSets, TLC

CONSTANT ExpectRest   \* TRUE: the run drained (the test checked NoLeakAtRest); check the end state too

VARIABLES i, lfail, ltaken, lpin
tvars == <<vars, i, lfail, ltaken, lpin>>

TraceInit == Init /\ i = 0 /\ lfail = [w \in Ranks |-> {}] /\ ltaken = [w \in Ranks |-> {}]
             /\ lpin = [k \in {} |-> 0]

SetOf(s) == {s[k] : k \in DOMAIN s}
LA == lastAction'
PinnedCount == Cardinality({j \in JobIds : j < nextJob' /\ jobs'[j].left > 0})
PinSum == Sum(ref', Blocks) - NumBlocks   \* pins only: see Baseline
SameGen(w, j) == ws'[w][jobs[j].r].g = jobs[j].g
Sched == <<status, gen, table, ncomp, emitted, ld, fs, content, free, buf, store, up, faults>>

\* The connector's scheduler side tells every rank that generation g of r is over.
Announce(r, g, kind) ==
    /\ notice' = [w \in Ranks |-> notice[w] \cup {<<r, g, kind>>}]
    /\ lastAction' = [name |-> IF kind = "finish" THEN "Finish" ELSE "Preempt", r |-> r, g |-> g]
    /\ UNCHANGED <<Sched, nextJob, jobs, ref, jp, ws, rep>>

\* The merged completed_saves of one engine step: `reported` gives <<job, ranks>>; which ranks' pending
\* reports reached this step is not logged, so every choice of that many reporting ranks is tried.
Pend(j) == {w \in Ranks : rep[w][j] > 0}
RECURSIVE Choices(_, _)
Choices(js, n) ==
    IF js = {} THEN {{}}
    ELSE LET j == CHOOSE x \in js : TRUE IN
         {c \cup {<<j, S>>} : c \in Choices(js \ {j}, n), S \in {S \in SUBSET Pend(j) : Cardinality(S) = n[j]}}

CollectObs(e) ==
    LET n == [j \in {rc[1] : rc \in SetOf(e.reported)} |-> (CHOOSE rc \in SetOf(e.reported) : rc[1] = j)[2]]
    IN \E pick \in Choices(DOMAIN n, n) :
         /\ CollectTaken([w \in Ranks |-> [j \in JobIds |-> IF \E p \in pick : p[1] = j /\ w \in p[2]
                                                           THEN 1 ELSE 0]])
         /\ e.unknown = 0
         /\ LA.released = SetOf(e.released)
         /\ \A lf \in SetOf(e.left) : jobs'[lf[1]].left = lf[2]
         /\ PinnedCount = e.pinned_jobs
         /\ PinSum = e.pinned_blocks

Step(e) ==
    \/ e.action = "EmitStore" /\ e.job = nextJob
         /\ OpenJob(e.r, e.g, e.blocks, e.tail, 1, 0)
         /\ e.left = Cardinality(Ranks) /\ PinnedCount = e.pinned_jobs /\ PinSum = e.pinned_blocks
         /\ UNCHANGED <<Sched, ws, rep, notice>>
    \/ e.action = "Preempt" /\ Announce(e.r, e.g, "preempt")
    \/ e.action = "Finish" /\ Announce(e.r, e.g, "finish")
    \/ e.action = "Receive" /\ ReceiveJob(e.w, e.job)
         /\ LA.r = e.r /\ LA.g = e.g
         /\ e.stale = (e.job \notin ws'[e.w][e.r].live)
         /\ (e.stale \/ ws'[e.w][e.r].live = SetOf(e.live))
    \/ e.action = "DropGeneration" /\ DropNotice(e.w, <<e.r, e.g, e.kind>>)
         /\ IF e.dest = "none" THEN ws'[e.w][e.r].live = ws[e.w][e.r].live
            ELSE /\ ws'[e.w][e.r].phase = e.dest
                 /\ ws'[e.w][e.r].live = SetOf(e.live)
    \/ e.action = "DmaRead" /\ DmaReadJob(e.w, e.job) /\ LA.outcome = e.outcome
    \/ e.action = "Put" /\ PutJob(e.w, e.job) /\ LA.outcome = e.outcome
         /\ e.live = (e.job \in ws[e.w][jobs[e.job].r].live)
    \/ e.action = "Report" /\ ReportJob(e.w, e.job) /\ LA.from = e.from
         /\ (SameGen(e.w, e.job) => ws'[e.w][jobs[e.job].r].live = SetOf(e.live))
    \/ e.action = "Collect" /\ CollectObs(e)

\* The scheduler's load pins (SchedulerLedger.pin_load / collect_loads).
LoadPinStep(e) ==
    \/ e.action = "EmitLoad"
         /\ e.lp \notin DOMAIN lpin /\ e.left = Cardinality(Ranks)
         /\ lpin' = lpin @@ (e.lp :> e.left)
         /\ Cardinality(DOMAIN lpin') = e.pinned_loads
    \/ e.action = "CollectLoad"
         /\ e.unknown = 0
         /\ (\A rc \in SetOf(e.reported) : rc[1] \in DOMAIN lpin /\ 0 < rc[2] /\ rc[2] <= lpin[rc[1]])
         /\ LET cnt(k) == IF \E p \in SetOf(e.reported) : p[1] = k
                         THEN (CHOOSE p \in SetOf(e.reported) : p[1] = k)[2] ELSE 0
                left == [k \in DOMAIN lpin |-> lpin[k] - cnt(k)]
                done == {k \in DOMAIN lpin : left[k] = 0} IN
            /\ done = SetOf(e.released)
            /\ lpin' = [k \in DOMAIN lpin \ done |-> left[k]]
            /\ \A lf \in SetOf(e.left) : lf[1] \in DOMAIN lpin' /\ lpin'[lf[1]] = lf[2]
            /\ Cardinality(DOMAIN lpin') = e.pinned_loads

LoadStep(e) ==
    \/ e.action = "Load"
         /\ (IF e.lp > 0 THEN e.lp \in DOMAIN lpin ELSE ~e.strict)   \* S9: the load is still pinned
         /\ SetOf(e.loaded) \cup SetOf(e.failed) = SetOf(e.attempted)
         /\ SetOf(e.loaded) \cap SetOf(e.failed) = {}
         /\ lfail' = [lfail EXCEPT ![e.w] = @ \cup (SetOf(e.failed) \ ltaken[e.w])]
         /\ ltaken' = [ltaken EXCEPT ![e.w] = @ \ SetOf(e.failed)]
    \/ e.action = "HandleLoadErrors"
         /\ lfail' = [lfail EXCEPT ![e.w] = @ \ SetOf(e.blocks)]
         /\ ltaken' = [ltaken EXCEPT ![e.w] = @ \cup (SetOf(e.blocks) \ lfail[e.w])]

\* Before the first event: the holders of a block that this log does not show (vLLM's request tables and
\* prefix cache) are folded into one reference per block, so a block's count is 1 + its pins and the
\* model's pool never frees a block here (pins drop to 1, never to 0: a release of more pins than were
\* taken empties no queue slot but leaves `free` non-empty, and no event matches after it).  This also
\* keeps the states small: a long log would otherwise grow the free queue with every release.
Baseline ==
    /\ i = 0 /\ free # <<>>
    /\ ref' = [b \in Blocks |-> 1]
    /\ free' = <<>>
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, content, jp, ws, rep, notice,
                   buf, store, up, faults, lastAction, i, lfail, ltaken, lpin>>

TraceNext ==
    \/ Baseline
    \/ /\ free = <<>>
       /\ i < Len(Trace)
       /\ i' = i + 1
       /\ LET e == Trace[i + 1] IN
          IF e.action \in {"Load", "HandleLoadErrors"} THEN LoadStep(e) /\ UNCHANGED <<vars, lpin>>
          ELSE IF e.action \in {"EmitLoad", "CollectLoad"} THEN LoadPinStep(e) /\ UNCHANGED <<vars, lfail, ltaken>>
          ELSE Step(e) /\ UNCHANGED <<lfail, ltaken, lpin>>

TraceSpec == TraceInit /\ [][TraceNext]_tvars

AtRest ==
    /\ PinnedJobs = {} /\ DOMAIN lpin = {}
    /\ \A w \in Ranks : /\ notice[w] = {} /\ lfail[w] = {} /\ ltaken[w] = {}
                       /\ \A j \in JobIds : j < nextJob => jp[w][j] = "released"
\* No trap invariant here (unlike TraceKVLedger): TLC would print the whole matched behaviour as the
\* "counterexample", and for a log of thousands of events of a real run that takes minutes.  Instead the
\* constraint prints "matched" when the whole log was matched (and the run ended at rest, if expected);
\* TLC then runs out of states and exits 0.  Accepted = exit 0 and "matched" printed.
FullyMatched == i = Len(Trace) /\ (ExpectRest => AtRest)
\* The furthest cursor reached (register 1), printed when it grows.
Furthest == /\ IF i > TLCGet(1) THEN TLCSet(1, i) /\ PrintT(<<"cursor", i>>) ELSE TRUE
            /\ IF FullyMatched THEN PrintT(<<"matched", i>>) ELSE TRUE
ASSUME TLCSet(1, 0)
=============================================================================
