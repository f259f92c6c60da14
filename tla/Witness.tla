---------------------------- MODULE Witness ----------------------------
(***************************************************************************)
(* Reachability witnesses: an invariant is only as good as the states it   *)
(* is checked in.  For each safety invariant and action property of        *)
(* KVLedger (spec/README.md S1-S9, LifecycleConforms), Witness_X is the    *)
(* hazard it guards against: the situation in which the bug it names would *)
(* strike.  conformance.witness checks NotWitness_X in the CI configs: a   *)
(* "violation" (TLC exit 12 for a state witness, 13 for a step witness) is *)
(* a shortest behaviour that reaches the hazard; a config in which TLC     *)
(* finds none never exercises the invariant (it holds vacuously there).    *)
(* Step witnesses speak about one step (primed variables): they are action *)
(* properties, which TLC checks on every transition, also into states the  *)
(* VIEW has already seen (a lastAction test in a state predicate would not *)
(* be).                                                                    *)
(***************************************************************************)
EXTENDS KVLedger

\* S1 NoPollution (#52360): a store job that a rank still has to read (queued, live) pins a block its
\* request has released (preempted/finished), while a running request must allocate a new block: without
\* the pin that block would be reused and the job would save another request's KV under its key.
Witness_S1 ==
    /\ \E r \in Req : status[r] = "running" /\ ld[r].ph = "done"
                      /\ ncomp[r] < NumChunks /\ ncomp[r] >= Len(table[r])
    /\ \E j \in PinnedJobs, w \in Ranks :
         /\ jp[w][j] = "queued" /\ j \in ws[w][jobs[j].r].live
         /\ \E b \in Range(PinSeq(jobs[j])) : b \notin Range(table[jobs[j].r])

\* S2 DmaReadsPinned (#52360): a rank's DMA read is in flight on a block its request no longer holds
\* (preempted or finished): only the job's pin keeps the block from being reallocated under the read.
Witness_S2 ==
    \E w \in Ranks, j \in JobIds :
        /\ jp[w][j] = "running"
        /\ \E p \in buf[w] : JobBlock(j, p[1]) \notin Range(table[jobs[j].r])

\* S2 DmaReadsPinned, partial tails (mutant NoTailPin): a rank's DMA read is in flight on a job's tail
\* block (the prompt's partial last block) while the job's request no longer holds it (preempted or
\* finished): only the job's tail pin keeps the block from reuse, and the read goes under the tail's key.
Witness_Tail ==
    \E w \in Ranks, j \in JobIds :
        /\ jp[w][j] = "running" /\ jobs[j].tail # 0
        /\ \E p \in buf[w] : p[1] = NumChunks /\ jobs[j].tail \notin Range(table[jobs[j].r])

\* S2 DmaReadsPinned, held requests: a rank's DMA read is in flight for the save a request's finish left
\* deferred at the pin cap, opened after the finish (the job that reaches the last chunk) while the
\* request is held: vLLM has been told the request finished, so only the held table and the job's pins
\* keep its blocks from reuse under the read (mutant FreeAtFinish frees them at the finish).
Witness_Held ==
    \E w \in Ranks, j \in JobIds :
        LET r == jobs[j].r IN
        /\ jp[w][j] = "running" /\ status[r] = "held"
        /\ jobs[j].g = gen[r] /\ jobs[j].hi = NumChunks

\* S3 RefCountExact (#43742, double free) [step]: a release drops one reference to a block another
\* holder keeps (a request table and a pin, or two pins): it must neither free it nor skip the decrement.
Witness_S3 == \E b \in Blocks : ref'[b] < ref[b] /\ ref'[b] > 0

\* S4 NoStaleEffect (#51637, ABA) [step]: a rank reports a job of an old generation after it registered
\* the request's newer generation (req_id reused): the report must leave the new generation's state alone.
Witness_S4 ==
    /\ lastAction'.name = "Report"
    /\ jobs[lastAction'.job].g < ws[lastAction'.w][jobs[lastAction'.job].r].g

\* S5 ReportedOnce: one rank has reported job j while another rank's DMA read of j is in flight: a second
\* report (ranks_left below the ranks still open) would release the pins under that read.
Witness_S5 == \E j \in JobIds, w, v \in Ranks : jp[w][j] = "reported" /\ jp[v][j] = "running"

\* S6 BoundedPins: EmitStore deferred by the cap: a request has computed unsaved chunks, a job id is left,
\* the engine is synced, and PinCap jobs hold pins (EmitStore's guard minus the cap holds).
Witness_S6 ==
    /\ Cardinality(PinnedJobs) >= PinCap /\ nextJob <= MaxJobs /\ EngineSynced
    /\ \E r \in Req : status[r] = "running" /\ ld[r].ph = "done" /\ emitted[r] < ncomp[r]

\* S7 NoGarbageCompute (#42788): a running request holds, right after its counted prefix, a block whose
\* load failed (it does not hold the request's chunk): it must be recomputed, never counted.
Witness_S7 ==
    \E r \in Req : /\ status[r] = "running" /\ ld[r].ph = "done"
                   /\ ncomp[r] < Len(table[r])
                   /\ content[table[r][ncomp[r] + 1]] # <<r, ncomp[r] + 1>>

\* S8 LoadErrorsReported (load path, #42788): a load finished in which a sub-batch failed and a later
\* sub-batch followed (the legacy load path stopped there, leaving the later keys unreported).
Witness_S8 ==
    \E r \in Req, w \in Ranks : /\ ld[r].ph = "loaded"
                                /\ \E i \in DOMAIN ld[r].st[w] :
                                     ld[r].st[w][i] = "fail" /\ ((i - 1) \div SubBatch + 1) * SubBatch < ld[r].n

\* S9 LoadsPinned: a request finished (was aborted) during its async load while a rank still has keys of
\* the load to write: its table is freed, so only the load's pin keeps those blocks from being reused.
Witness_S9 ==
    \E r \in Req : /\ status[r] = "finished" /\ ld[r].ph = "loading" /\ LoadPending(r)
                   /\ \E b \in Range(ld[r].dst) : b \notin Range(table[r])

\* LifecycleConforms [step]: a rank's request state closes on the last Report after the finish notice
\* (closing -> closed): the notice came while jobs were live, the longest path of both machines.
Witness_Lifecycle ==
    \E w \in Ranks, r \in Req : /\ ws[w][r].phase = "closing" /\ ws'[w][r].phase = "closed"
                                /\ ws'[w][r].g = ws[w][r].g /\ lastAction'.name = "Report"

\* Two store jobs hold pins at once (the cap above 1 is used; ref counts carry several pins).
Witness_TwoPins == Cardinality(PinnedJobs) >= 2

\* One block pinned by two jobs (a job and its successor of the same generation both hold it).
Witness_SharedPin == \E b \in Blocks : Cardinality({j \in PinnedJobs : b \in Range(PinSeq(jobs[j]))}) >= 2

\* A DMA read finds its job stale because the rank registered the request's newer generation: on the
\* reset_prefix_cache path (no preemption notice) only the job's generation tells old from new.
Witness_StaleDmaRead ==
    \E w \in Ranks, j \in JobIds : jp[w][j] = "stale" /\ jobs[j].g < ws[w][jobs[j].r].g

\* Stripe (identical KV stored once) [step]: a rank loads a key that only another rank put: what it reads
\* must still be the chunk's content (S7), the same as if it had put it itself.
Witness_CrossRank ==
    /\ Stripe /\ lastAction'.name = "Load"
    /\ \E i \in lastAction'.keys \ lastAction'.failed : Owner(i) # lastAction'.w

\* Stripe: a request about to look up finds its first chunk's key missing (its owner's put failed, or its
\* job went stale) while
\* the other rank's key of a later chunk is stored: the hit must stop at the hole, never count past it (S7).
Witness_StripeHole ==
    /\ Stripe
    /\ \E r \in Req : /\ status[r] = "running" /\ ld[r].ph = "idle"
                      /\ store[<<r, 1>>] = NoContent
                      /\ \E i \in Chunks : store[<<r, i>>] # NoContent

\* Register's OTHER arm [step]: a rank receives a job of a generation it has closed or outgrown.  Not a
\* gate: no config reaches it (MC_safety, MC_lag, MC_nonotice, MC_deep_lag searched in full).  A rank
\* receives jobs in id order before the next schedule() (EngineSynced), and a notice waits until its
\* generation's jobs are received, so a job never arrives after its generation closed on that rank;
\* the arm is the runtime's defence (TraceRuntime replays logged orders through the same Register).
Witness_RegisterOther ==
    /\ lastAction'.name = "Receive" /\ ~Keyed
    /\ LET s == ws[lastAction'.w][lastAction'.r]  g == lastAction'.g
       IN ~(g > s.g) /\ ~(g = s.g /\ s.phase = "open")

\* What TLC checks: a state witness as an invariant, a step witness as an action property.
NotWitness_S1 == ~Witness_S1
NotWitness_S2 == ~Witness_S2
NotWitness_Tail == ~Witness_Tail
NotWitness_Held == ~Witness_Held
NotWitness_S3 == [][~Witness_S3]_vars
NotWitness_S4 == [][~Witness_S4]_vars
NotWitness_S5 == ~Witness_S5
NotWitness_S6 == ~Witness_S6
NotWitness_S7 == ~Witness_S7
NotWitness_S8 == ~Witness_S8
NotWitness_S9 == ~Witness_S9
NotWitness_Lifecycle == [][~Witness_Lifecycle]_vars
NotWitness_TwoPins == ~Witness_TwoPins
NotWitness_SharedPin == ~Witness_SharedPin
NotWitness_StaleDmaRead == ~Witness_StaleDmaRead
NotWitness_RegisterOther == [][~Witness_RegisterOther]_vars
NotWitness_CrossRank == [][~Witness_CrossRank]_vars
NotWitness_StripeHole == ~Witness_StripeHole
=============================================================================
