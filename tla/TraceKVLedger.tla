--------------------------- MODULE TraceKVLedger ---------------------------
(***************************************************************************)
(* Trace validation of KVLedger: TLC checks that a runtime NDJSON log is a  *)
(* behaviour of the model.  TraceData.tla (`Trace`, one record per event,  *)
(* in the model's vocabulary) is written by conformance.kvtrace.           *)
(*                                                                         *)
(* The cursor i counts matched events.  Each step is the model action the   *)
(* next event names, with the event's parameters, and the event's observed  *)
(* values (pins, ranks_left, live sets, offsets, outcomes) must equal the   *)
(* model's after the step (an EmitStore's blocks are all its pins, its      *)
(* partial tail last; its tail, when logged, is the model job's tail). A    *)
(* runtime Load event folds one rank's whole load: the model's Load sub-    *)
(* batches of that rank match it, the cursor moves on the last one.  A     *)
(* held Finish logs nothing (no notice goes out): the model takes it       *)
(* between events, and the Finish event (the notice) is its ReleaseHeld.   *)
(* NotFullyMatched is a trap: TLC violates it (exit 12) exactly when the    *)
(* whole log was matched.  Furthest keeps the largest cursor reached in TLC *)
(* register 1 and prints it when it grows, so the first event the model     *)
(* cannot match is furthest + 1.                                            *)
(***************************************************************************)
EXTENDS KVLedger, TraceData, Naturals, Sequences, FiniteSets, TLC

VARIABLE i
tvars == <<vars, i>>

TraceInit == Init /\ i = 0

SetOf(s) == {s[k] : k \in DOMAIN s}
LA == lastAction'
PinnedCount == Cardinality({j \in JobIds : j < nextJob' /\ jobs'[j].left > 0})

\* A job's partial tail as the log lists it: the block, or none.
TailSeq(jb) == IF jb.tail = 0 THEN <<>> ELSE <<jb.tail>>

\* The state of the job's own generation on rank w (after the step), if it is still the one kept.
SameGen(w, j) == ws'[w][jobs[j].r].g = jobs[j].g

Step(e) ==
    \/ e.action = "Admit" /\ Admit(e.r) /\ LA.g = e.g
    \/ e.action = "Lookup" /\ Lookup(e.r) /\ LA.hits = e.hits
    \/ e.action = "EmitLoad" /\ EmitLoad(e.r) /\ table'[e.r] = e.blocks
    \/ e.action = "CollectLoad" /\ CollectLoad(e.r) /\ LA.blocks = e.blocks
    \/ e.action = "HandleLoadErrors" /\ HandleLoadErrors(e.r) /\ LA.keep = e.keep
    \/ e.action = "Compute" /\ Compute(e.r) /\ LA.c = e.c /\ LA.b = e.b
    \/ e.action = "EmitStore" /\ EmitStore(e.r)
         /\ LA.job = e.job /\ PinSeq(jobs'[e.job]) = e.blocks /\ jobs'[e.job].left = e.left
         /\ ("tail" \in DOMAIN e => e.tail = TailSeq(jobs'[e.job]))   \* logs before the field: pins only
         /\ PinnedCount = e.pinned_jobs
    \/ e.action = "Preempt" /\ Preempt(e.r) /\ LA.g = e.g
    \* the finish notice: a Finish that is not held, or a held request's ReleaseHeld (see HeldFinish)
    \/ e.action = "Finish" /\ Finish(e.r) /\ ~LA.held /\ LA.g = e.g
    \/ e.action = "Finish" /\ ReleaseHeld(e.r) /\ LA.g = e.g
    \/ e.action = "Collect" /\ Collect
         /\ LA.released = SetOf(e.released)
         /\ {j \in JobIds : RepCount(j) > 0} = {rp[1] : rp \in SetOf(e.reported)}
         /\ \A rc \in SetOf(e.reported) : RepCount(rc[1]) = rc[2]
         /\ \A lf \in SetOf(e.left) : jobs'[lf[1]].left = lf[2]
         /\ PinnedCount = e.pinned_jobs
    \/ e.action = "Receive" /\ Receive(e.w)
         /\ LA.job = e.job /\ LA.r = e.r /\ LA.g = e.g
         /\ (e.stale \/ ws'[e.w][e.r].live = SetOf(e.live))
    \/ e.action = "DropGeneration" /\ DropGeneration(e.w)
         /\ LA.r = e.r /\ LA.g = e.g /\ LA.kind = e.kind
         /\ IF e.dest = "none" THEN ws'[e.w][e.r].live = ws[e.w][e.r].live
            ELSE /\ ws'[e.w][e.r].phase = e.dest
                 /\ ws'[e.w][e.r].live = SetOf(e.live)
    \/ e.action = "DmaRead" /\ DmaRead(e.w)
         /\ LA.job = e.job /\ LA.outcome = e.outcome
         /\ (e.outcome # "running" \/ ws[e.w][jobs[e.job].r].off = e.off)
    \/ e.action = "Put" /\ Put(e.w)
         /\ LA.job = e.job /\ LA.outcome = e.outcome
         /\ e.live = (e.job \in ws[e.w][jobs[e.job].r].live)
         /\ (~e.live \/ ws'[e.w][jobs[e.job].r].off = e.off)
    \/ e.action = "Report" /\ Report(e.w)
         /\ LA.job = e.job /\ LA.from = e.from
         /\ (SameGen(e.w, e.job) => ws'[e.w][jobs[e.job].r].live = SetOf(e.live))
    \/ e.action = "Evict" /\ Evict(e.k)
    \/ e.action = "StoreFail" /\ StoreFail
    \/ e.action = "StoreRestart" /\ StoreRestart

\* One sub-batch of a folded Load event; the cursor moves when rank w has no pending key left, and
\* then the blocks the rank attempted and failed must be the logged ones.
LoadStep(e) ==
    /\ Load(e.w, e.r)
    /\ LET st == ld'[e.r].st[e.w] IN
       IF \E k \in DOMAIN st : st[k] = "pending" THEN i' = i
       ELSE /\ i' = i + 1
            /\ {ld[e.r].dst[k] : k \in DOMAIN st} = SetOf(e.attempted)
            /\ {ld[e.r].dst[k] : k \in {x \in DOMAIN st : st[x] # "ok"}} = SetOf(e.failed)

\* A request held at its finish (its save deferred at the cap): the connector's request_finished answers
\* delay-free, sends no notice and logs nothing, so the model takes it between two events; the Finish
\* event (the notice) comes at ReleaseHeld.
HeldFinish == \E r \in Req : Finish(r) /\ LA.held /\ i' = i

TraceNext ==
    /\ i < Len(Trace)
    /\ \/ LET e == Trace[i + 1] IN
          IF e.action = "Load" THEN LoadStep(e) ELSE Step(e) /\ i' = i + 1
       \/ HeldFinish

TraceSpec == TraceInit /\ [][TraceNext]_tvars

\* Trap: violated exactly when the whole log was matched (TLC exit 12 = accepted).
NotFullyMatched == i < Len(Trace)
\* The furthest cursor reached (register 1), printed when it grows.
Furthest == IF i > TLCGet(1) THEN TLCSet(1, i) /\ PrintT(<<"cursor", i>>) ELSE TRUE
ASSUME TLCSet(1, 0)
=============================================================================
