---------------------------- MODULE KVLedger ----------------------------
(***************************************************************************)
(* The job lifecycle of asynchronous KV-cache saves and loads in vLLM      *)
(* (spec/README.md): one scheduler, N worker ranks, a block pool, a      *)
(* Mooncake-like store and the load path.                                  *)
(*                                                                         *)
(* Two designs share this module, chosen by the constant Legacy:           *)
(*  - fixed (Legacy = FALSE): every store job has a monotonic id and pins  *)
(*    every block of its request's table when emitted; each rank reports   *)
(*    each job exactly once; Collect releases pins tail first when all     *)
(*    ranks reported; the worker ledger is req_id -> generation's live job *)
(*    set; every failed load is reported.                                  *)
(*  - legacy (Legacy = TRUE), as upstream had it: no pins, a per-req_id    *)
(*    in-flight counter on the worker, blocks of a finished request kept   *)
(*    (delay-free) until every rank says finished_sending, preemption      *)
(*    frees blocks at once, and the load path stops at the first failing   *)
(*    sub-batch without reporting the rest.                                *)
(* Mutant (a string) seeds one bug into the fixed design, so that we can   *)
(* see the invariants are not vacuous: "none", "NoPin", "ReportTwice",     *)
(* "KeyedByReqId", "NoCap", "LoadPinFirstRank", "NoTailPin",               *)
(* "FreeAtFinish".                                                         *)
(*                                                                         *)
(* Partial tails (PartialTail = TRUE, the connector's save_partial_tail):  *)
(* chunk NumChunks of every request is its prompt's partial last block.  A *)
(* store job whose range reaches it records that block as its tail         *)
(* (jobs[j].tail; blocks then holds table[r][1..NumChunks-1]), pins it and *)
(* releases it first (SchedulerLedger.open_job's tail_block_ids).  Once    *)
(* the request is preempted or finished, only that pin keeps the block     *)
(* from reuse while ranks still read it (mutant "NoTailPin" drops it).     *)
(*                                                                         *)
(* Held requests (fixed design, vLLM's delay-free of request_finished): a  *)
(* request that finishes while its save is deferred at the pin cap becomes *)
(* "held" (at most MaxHeld at once): its table stays allocated and no      *)
(* finish notice goes out, so the ranks still run its jobs; EmitStore      *)
(* opens the deferred save when the cap allows, and ReleaseHeld frees the  *)
(* table and sends the notice once that job is released.  With MaxHeld     *)
(* held already, the save is given up: the request finishes at once.       *)
(* Mutant "FreeAtFinish" frees the table at Finish but still holds the     *)
(* request, so its deferred job pins blocks another request may reuse.     *)
(*                                                                         *)
(* Loads (fixed design): EmitLoad pins the load's destination blocks for   *)
(* the load (ld[r].pin); a request may finish (abort) while its load runs, *)
(* freeing its table at once; the pin keeps the blocks until CollectLoad,   *)
(* when every rank finished the load (vLLM's finished_recving).            *)
(*                                                                         *)
(* Content model: chunk c of request r has content <<r, c>>; its store key *)
(* is <<r, c>> too, so NoPollution is "store[k] = k".  Every rank writes   *)
(* and reads the same keys: the ranks of one shard share them.             *)
(*                                                                         *)
(* Identical KV stored once (Stripe = TRUE: MLA, replicated KV heads): the *)
(* ranks hold the same bytes and share keys, and each key is put by one    *)
(* rank only, Owner(c) (kvledger.put_positions); every rank loads every     *)
(* key.  Why this is safe: a rank's job is "stored" once its own share is  *)
(* put, so a key another rank failed to put is simply absent; a lookup     *)
(* hits only the prefix of chunks whose keys all exist (Hits), and a key   *)
(* lost after the lookup fails that rank's load and is reported (S8).      *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC, JobLifecycle

CONSTANTS
    Req,            \* request ids (model values); a preempted id comes back as a new generation
    Ranks,          \* worker ranks (model values)
    NoReq,          \* a model value: the owner of "no content"
    NumBlocks,      \* GPU KV blocks in the pool; small so that blocks are reused
    NumChunks,      \* chunks (one block each) per request
    MaxGen,         \* generations per request (MaxGen - 1 preemptions)
    MaxJobs,        \* store job ids available to the model (bounds the state space)
    PinCap,         \* cap on in-flight pinned jobs: at the cap EmitStore waits (deferred, never dropped)
    MaxHeld,        \* requests that may be held at once (finished, their deferred save still to run; see above)
    MaxFaults,      \* budget of store faults injected in one behaviour
    FaultKinds,     \* which faults the adversary may inject: a subset of
                    \* {"evict", "fail" (StoreFail then StoreRestart losing all keys), "put" (a put fails),
                    \*  "pressure" (put answers no-space), "dma" (the handler raises before the read),
                    \*  "load" (a load sub-batch fails in transfer)}
    SubBatch,       \* keys per load sub-batch
    PreemptNotices, \* FALSE = the reset_prefix_cache path: workers never hear of a preemption
    LateNotices,    \* TRUE: a notice may arrive any time later (even after the next generation's
                    \* jobs); FALSE: by the next engine step, as vLLM's step metadata delivers it
    PartialTail,    \* TRUE: chunk NumChunks is the prompt's partial tail, pinned as a job's tail (see above)
    Stripe,         \* TRUE: the ranks hold identical KV; each key is put by its Owner only (see above)
    Legacy,         \* TRUE = the upstream design before the fix
    Mutant          \* "none" or the name of one seeded bug (see above)

ASSUME NumBlocks >= NumChunks /\ MaxGen >= 1 /\ PinCap >= 1 /\ SubBatch >= 1 /\ MaxHeld \in Nat
ASSUME PartialTail \in BOOLEAN /\ Stripe \in BOOLEAN
ASSUME Mutant \in {"none", "NoPin", "ReportTwice", "KeyedByReqId", "NoCap", "LoadPinFirstRank", "NoTailPin",
                   "FreeAtFinish"}

Blocks  == 1..NumBlocks
Chunks  == 1..NumChunks
JobIds  == 1..MaxJobs
Keys    == Req \X Chunks
NoContent == <<NoReq, 0>>
Content == (Req \X Chunks) \cup {NoContent}
FirstReq == CHOOSE r \in Req : TRUE
NoJob == [r |-> FirstReq, g |-> 0, blocks |-> <<>>, tail |-> 0, lo |-> 1, hi |-> 0, left |-> 0]
BusyPhases == {"running", "stored", "failed", "stale", "skipped"}   \* the rank's store thread holds a job
OpenPhases == {"emitted", "queued"} \cup BusyPhases                   \* not yet reported

VARIABLES
    \* ---- scheduler (what vLLM's Scheduler and the connector's scheduler side observe)
    status,   \* status[r] \in {"waiting","running","preempted","held","finished"}
    gen,      \* gen[r]: the request's generation (number of admissions so far)
    table,    \* table[r]: block table, a sequence of block ids; chunk i lives in table[r][i]
    ncomp,    \* ncomp[r]: chunks computed (or loaded and validated) in this generation
    emitted,  \* emitted[r]: chunks covered by store jobs already emitted in this generation
    ld,       \* ld[r]: load state [ph, n (keys to load), st (rank -> per-key result), bad (reported invalid),
              \*        dst (destination blocks, key i -> dst[i]), pin (the load holds a pin on dst)]
    nextJob,  \* the global monotonic store_job_id counter
    jobs,     \* jobs[j]: [r, g, blocks (pinned, in table order), tail (the partial tail's block, pinned
              \*          after blocks; 0 = none), lo..hi (chunks to save), left (ranks_left)]
    fs,       \* legacy only: fs[r] = ranks that reported finished_sending(r)
    \* ---- block pool
    ref,      \* ref[b]: reference count (requests holding b in their table + pinned jobs)
    content,  \* content[b]: the chunk the block holds; reuse overwrites it
    free,     \* free block queue: allocation takes the head, each free call prepends (see Unref)
    \* ---- worker ranks
    jp,       \* jp[w][j]: phase of job j on rank w (StoreJob machine of spec/machines.json, or "none")
    ws,       \* ws[w][r]: StoreRequestState [g, live (job ids), n (legacy counter), off (saved offset),
              \*           skip (pressure flag), phase (StoreRequest machine)]; g is the generation
              \*           it serves (for the legacy counter: the newest generation it has seen)
    rep,      \* rep[w][j]: pending completed-save reports of rank w (count; the scheduler merges them)
    notice,   \* notice[w]: pending DropGeneration notices <<r, g, kind>>, kind \in {"preempt","finish"}
    buf,      \* buf[w]: what the rank's DMA read of the running job got: set of <<chunk, content>>
    \* ---- store
    store,    \* store[k]: content held under key k (NoContent = absent)
    up,       \* the store master answers
    faults,   \* store faults injected so far (bounded by MaxFaults)
    lastAction \* [name |-> action, params...] of the step that led here

vars == <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free,
          jp, ws, rep, notice, buf, store, up, faults, lastAction>>

\* The state without lastAction: configs that do not export the graph fingerprint by this VIEW
\* (the same state reached by different actions is one state).
View == <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free,
          jp, ws, rep, notice, buf, store, up, faults>>

-----------------------------------------------------------------------------
Range(s) == {s[i] : i \in DOMAIN s}
Min(S) == CHOOSE m \in S : \A x \in S : m <= x
Max2(a, b) == IF a >= b THEN a ELSE b
Reverse(s) == [i \in 1..Len(s) |-> s[Len(s) - i + 1]]

RECURSIVE SortedSeq(_)
SortedSeq(S) == IF S = {} THEN <<>> ELSE <<Min(S)>> \o SortedSeq(S \ {Min(S)})

RECURSIVE Sum(_, _)
Sum(f, S) == IF S = {} THEN 0 ELSE LET x == CHOOSE x \in S : TRUE IN f[x] + Sum(f, S \ {x})

\* Free calls in order (calls: a sequence of block sequences), as vLLM 0.32's BlockPool.free_blocks
\* with caching off: each call drops one reference to each of its blocks, in order, and prepends the
\* blocks whose count reached 0, in that order, to the free queue (the first becomes the head: LIFO
\* reuse).  zs: the blocks the call in progress (Head(calls)) zeroed so far.  Returns <<ref, free>>.
\* One recursion, no LET-bound tuple results: with TLC 2.15 a version that destructured each call's
\* <<ref, free>> through LET made MC_live's liveness check about 2.5x slower.
RECURSIVE FreeCalls(_, _, _, _)
FreeCalls(calls, rf, fl, zs) ==
    IF calls = <<>> THEN <<rf, fl>>
    ELSE IF Head(calls) = <<>> THEN FreeCalls(Tail(calls), rf, zs \o fl, <<>>)
    ELSE LET b == Head(Head(calls))
         IN FreeCalls(<<Tail(Head(calls))>> \o Tail(calls), [rf EXCEPT ![b] = @ - 1], fl,
                      IF rf[b] = 1 THEN Append(zs, b) ELSE zs)

\* One free call (BlockPool.free_blocks(bs)); several in order.
Unref(bs, rf, fl) == FreeCalls(<<bs>>, rf, fl, <<>>)
UnrefEach(calls, rf, fl) == FreeCalls(calls, rf, fl, <<>>)

\* Release blocks tail first (vLLM frees a request's blocks in one call, in reverse, so shared
\* prefixes stay longest).
ReleaseTailFirst(bs) == Unref(Reverse(bs), ref, free)

Pin(bs) == [b \in Blocks |-> IF b \in Range(bs) THEN ref[b] + 1 ELSE ref[b]]

\* The blocks a job record jb pins, in pin order: its blocks, then its tail (SchedulerLedger.open_job's
\* block_ids then tail_block_ids).  Mutant NoTailPin: the tail is neither pinned nor released.
PinSeq(jb) == IF jb.tail = 0 \/ Mutant = "NoTailPin" THEN jb.blocks ELSE Append(jb.blocks, jb.tail)
\* The block job j reads chunk c from: the tail for the last chunk when the job has one.
JobBlock(j, c) == IF c = NumChunks /\ jobs[j].tail # 0 THEN jobs[j].tail ELSE jobs[j].blocks[c]

Pinned(j) == j < nextJob /\ jobs[j].left > 0 /\ ~Legacy
PinnedJobs == {j \in JobIds : Pinned(j)}
FaultOK == faults < MaxFaults
Fault(kind) == FaultOK /\ kind \in FaultKinds
Fresh(g, ph) == [g |-> g, live |-> {}, n |-> 0, off |-> 0, skip |-> FALSE, phase |-> ph]
LdIdle(ph, n) == [ph |-> ph, n |-> n, st |-> [w \in Ranks |-> <<>>], bad |-> {}, dst |-> <<>>, pin |-> FALSE]
\* Keys of r's load that some rank still has to load (each a write into its destination block).
LoadPending(r) == \E w \in Ranks : \E i \in DOMAIN ld[r].st[w] : ld[r].st[w][i] = "pending"

-----------------------------------------------------------------------------
Init ==
    /\ status = [r \in Req |-> "waiting"]
    /\ gen = [r \in Req |-> 0]
    /\ table = [r \in Req |-> <<>>]
    /\ ncomp = [r \in Req |-> 0]
    /\ emitted = [r \in Req |-> 0]
    /\ ld = [r \in Req |-> LdIdle("idle", 0)]
    /\ nextJob = 1
    /\ jobs = [j \in JobIds |-> NoJob]
    /\ fs = [r \in Req |-> {}]
    /\ ref = [b \in Blocks |-> 0]
    /\ content = [b \in Blocks |-> NoContent]
    /\ free = [i \in 1..NumBlocks |-> i]
    /\ jp = [w \in Ranks |-> [j \in JobIds |-> "none"]]
    /\ ws = [w \in Ranks |-> [r \in Req |-> Fresh(0, "closed")]]
    /\ rep = [w \in Ranks |-> [j \in JobIds |-> 0]]
    /\ notice = [w \in Ranks |-> {}]
    /\ buf = [w \in Ranks |-> {}]
    /\ store = [k \in Keys |-> NoContent]
    /\ up = TRUE
    /\ faults = 0
    /\ lastAction = [name |-> "Init"]

-----------------------------------------------------------------------------
(* Scheduler.  vLLM's engine step: schedule() emits jobs and notices; every rank binds that step's
   metadata (Receive) before the next schedule(); the engine merges the ranks' completed-save reports
   (Collect) in update_from_output before the next schedule().  So a scheduler action needs every
   emitted job received and every returned report collected.  The ranks' store threads (DmaRead, Put,
   Report), the loads and the DropGeneration notices stay fully asynchronous. *)
EngineSynced ==
    \A w \in Ranks : /\ \A j \in JobIds : jp[w][j] # "emitted" /\ rep[w][j] = 0
                    /\ (LateNotices \/ notice[w] = {})

Admit(r) ==
    /\ EngineSynced
    /\ status[r] \in {"waiting", "preempted"}
    /\ gen[r] < MaxGen
    /\ status' = [status EXCEPT ![r] = "running"]
    /\ gen' = [gen EXCEPT ![r] = @ + 1]
    /\ ld' = [ld EXCEPT ![r].ph = "idle"]
    /\ lastAction' = [name |-> "Admit", r |-> r, g |-> gen[r] + 1]
    /\ UNCHANGED <<table, ncomp, emitted, nextJob, jobs, fs, ref, content, free, jp, ws, rep, notice,
                   buf, store, up, faults>>

\* Prefix hit in the store: the longest run of keys present from chunk 1.
Hits(r) == IF ~up THEN 0
           ELSE LET ok == {k \in 0..NumChunks : \A i \in 1..k : store[<<r, i>>] # NoContent}
                IN CHOOSE k \in ok : \A x \in ok : x <= k

Lookup(r) ==
    /\ EngineSynced
    /\ status[r] = "running" /\ ld[r].ph = "idle"
    /\ LET h == Hits(r) IN
         /\ ld' = [ld EXCEPT ![r] = LdIdle(IF h = 0 THEN "done" ELSE "looked", h)]
         /\ lastAction' = [name |-> "Lookup", r |-> r, hits |-> h]
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, nextJob, jobs, fs, ref, content, free, jp, ws,
                   rep, notice, buf, store, up, faults>>

\* Allocate blocks for the hit and ask every rank to load them (content stays garbage until loaded).
\* Fixed: the load pins its destination blocks (SchedulerLedger.pin_load): ref 2 = table + load pin.
EmitLoad(r) ==
    /\ EngineSynced
    /\ status[r] = "running" /\ ld[r].ph = "looked"
    /\ Len(free) >= ld[r].n
    /\ LET n == ld[r].n
           bs == SubSeq(free, 1, n) IN
         /\ table' = [table EXCEPT ![r] = bs]
         /\ free' = SubSeq(free, n + 1, Len(free))
         /\ ref' = [b \in Blocks |-> IF b \in Range(bs) THEN (IF Legacy THEN 1 ELSE 2) ELSE ref[b]]
         /\ ld' = [ld EXCEPT ![r].ph = "loading", ![r].dst = bs, ![r].pin = ~Legacy,
                             ![r].st = [w \in Ranks |-> [i \in 1..n |-> "pending"]]]
         /\ lastAction' = [name |-> "EmitLoad", r |-> r, blocks |-> bs]
    /\ UNCHANGED <<status, gen, ncomp, emitted, nextJob, jobs, fs, content, jp, ws, rep, notice, buf,
                   store, up, faults>>

\* The recompute policy: keep the prefix before the first reported invalid block, recompute the rest.
HandleLoadErrors(r) ==
    /\ EngineSynced
    /\ status[r] = "running" /\ ld[r].ph = "loaded" /\ ~ld[r].pin
    /\ LET k == IF ld[r].bad = {} THEN ld[r].n ELSE Min(ld[r].bad) - 1 IN
         /\ ncomp' = [ncomp EXCEPT ![r] = k]
         /\ emitted' = [emitted EXCEPT ![r] = k]    \* loaded chunks are in the store already
         \* the load's bookkeeping is done with: clear it (fewer distinct states, same behaviour)
         /\ ld' = [ld EXCEPT ![r] = LdIdle("done", 0)]
         /\ lastAction' = [name |-> "HandleLoadErrors", r |-> r, bad |-> ld[r].bad, keep |-> k]
    /\ UNCHANGED <<status, gen, table, nextJob, jobs, fs, ref, content, free, jp, ws, rep, notice,
                   buf, store, up, faults>>

\* Every rank finished r's load (vLLM's finished_recving): SchedulerLedger.collect_loads drops the load's
\* pins, tail first.  A request that finished (aborted) during the load is done with it here.
CollectLoad(r) ==
    /\ ld[r].ph = "loaded" /\ ld[r].pin
    /\ LET rel == ReleaseTailFirst(ld[r].dst) IN
         /\ ref' = rel[1]
         /\ free' = rel[2]
    /\ ld' = [ld EXCEPT ![r] = IF status[r] = "finished" THEN LdIdle("done", 0) ELSE [@ EXCEPT !.pin = FALSE]]
    /\ lastAction' = [name |-> "CollectLoad", r |-> r, blocks |-> ld[r].dst]
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, nextJob, jobs, fs, content, jp, ws, rep, notice,
                   buf, store, up, faults>>

\* Compute the next chunk: in place when the table already has its block (recompute), else allocate.
Compute(r) ==
    /\ EngineSynced
    /\ status[r] = "running" /\ ld[r].ph = "done"
    /\ ncomp[r] < NumChunks
    /\ LET c == ncomp[r] + 1
           inPlace == c <= Len(table[r]) IN
         /\ inPlace \/ free # <<>>
         /\ LET b == IF inPlace THEN table[r][c] ELSE Head(free) IN
              /\ content' = [content EXCEPT ![b] = <<r, c>>]
              /\ table' = IF inPlace THEN table ELSE [table EXCEPT ![r] = Append(@, b)]
              /\ free' = IF inPlace THEN free ELSE Tail(free)
              /\ ref' = IF inPlace THEN ref ELSE [ref EXCEPT ![b] = 1]
              /\ lastAction' = [name |-> "Compute", r |-> r, c |-> c, b |-> b]
         /\ ncomp' = [ncomp EXCEPT ![r] = c]
    /\ UNCHANGED <<status, gen, emitted, ld, nextJob, jobs, fs, jp, ws, rep, notice, buf, store, up,
                   faults>>

CapOK == Legacy \/ Mutant = "NoCap" \/ Cardinality(PinnedJobs) < PinCap

\* The ledger's part of EmitStore (the scheduler ledger's open_job): the next id, pins on bs and on the
\* tail tl (0 = none), every rank gets the job.  (TraceRuntime, which checks logs of real vLLM runs, uses
\* it with the logged values.)
OpenJob(r, g, bs, tl, lo, hi) ==
    /\ nextJob <= MaxJobs
    /\ CapOK
    /\ LET j == nextJob
           jb == [r |-> r, g |-> g, blocks |-> bs, tail |-> tl, lo |-> lo, hi |-> hi,
                  left |-> IF Legacy THEN 0 ELSE Cardinality(Ranks)] IN
         /\ jobs' = [jobs EXCEPT ![j] = jb]
         /\ ref' = IF Legacy \/ Mutant = "NoPin" THEN ref ELSE Pin(PinSeq(jb))
         /\ jp' = [w \in Ranks |-> [jp[w] EXCEPT ![j] = "emitted"]]
         /\ lastAction' = [name |-> "EmitStore", r |-> r, job |-> j, g |-> g, lo |-> lo, hi |-> hi]
    /\ nextJob' = nextJob + 1

\* A new store job: fresh id, pins every computed block of the table, from the first (a rank resumes
\* from its own offset, which can lag, so it may read any of them; blocks past ncomp[r] -- left by a
\* load whose later keys failed -- hold nothing to save).  At the cap the save is deferred: emitted[r]
\* stays behind ncomp[r], so EmitStore is enabled again once a pin is released.  PartialTail: a job
\* that reaches the last chunk (then the table has NumChunks blocks) pins that block as its tail.
\* A held request's deferred save is opened the same way (its table is still allocated).
EmitStore(r) ==
    /\ EngineSynced
    /\ status[r] \in {"running", "held"} /\ ld[r].ph = "done"
    /\ emitted[r] < ncomp[r]
    /\ LET tl == IF PartialTail /\ ncomp[r] = NumChunks THEN table[r][NumChunks] ELSE 0
           bs == SubSeq(table[r], 1, IF tl = 0 THEN ncomp[r] ELSE NumChunks - 1) IN
       OpenJob(r, gen[r], bs, tl, emitted[r] + 1, ncomp[r])
    /\ emitted' = [emitted EXCEPT ![r] = ncomp[r]]
    /\ UNCHANGED <<status, gen, table, ncomp, ld, fs, content, free, ws, rep, notice, buf, store, up,
                   faults>>

\* Preemption frees the request's blocks at once (pinned ones stay held by their jobs).
Preempt(r) ==
    /\ EngineSynced
    /\ status[r] = "running" /\ ld[r].ph = "done"
    /\ gen[r] < MaxGen
    /\ LET rel == ReleaseTailFirst(table[r]) IN
         /\ ref' = rel[1]
         /\ free' = rel[2]
    /\ status' = [status EXCEPT ![r] = "preempted"]
    /\ table' = [table EXCEPT ![r] = <<>>]
    /\ ncomp' = [ncomp EXCEPT ![r] = 0]
    /\ emitted' = [emitted EXCEPT ![r] = 0]
    /\ notice' = IF PreemptNotices /\ ~Legacy
                 THEN [w \in Ranks |-> notice[w] \cup {<<r, gen[r], "preempt">>}]
                 ELSE notice
    /\ lastAction' = [name |-> "Preempt", r |-> r, g |-> gen[r]]
    /\ UNCHANGED <<gen, ld, nextJob, jobs, fs, content, jp, ws, rep, buf, store, up, faults>>

\* Finish once every chunk is computed and covered by a store job (or the model ran out of job ids).
\* Fixed: the request's table is freed now; its jobs' pins own the blocks.  Legacy: delay-free,
\* the blocks stay until every rank said finished_sending(r).  Fixed design: a request may also finish
\* (be aborted) while its async load runs: its table is freed at once, the load's pin keeps the blocks.
\* Fixed design, save deferred at the cap (Deferred): below MaxHeld held requests the request is held
\* (table kept, no notice yet: the ranks must still run its deferred job; ReleaseHeld ends it), else its
\* save is given up and it finishes as above.  Mutant FreeAtFinish: held, but the table's blocks are
\* freed now (table[r] keeps their ids, so the deferred job pins blocks another request may reuse).
Deferred(r) == ~Legacy /\ ld[r].ph = "done" /\ ncomp[r] = NumChunks /\ emitted[r] < ncomp[r]
               /\ ~CapOK /\ nextJob <= MaxJobs
HeldReqs == {q \in Req : status[q] = "held"}
Finish(r) ==
    /\ EngineSynced
    /\ status[r] = "running"
    /\ \/ /\ ld[r].ph = "done"
          /\ ncomp[r] = NumChunks
          /\ emitted[r] = ncomp[r] \/ nextJob > MaxJobs
       \/ ~Legacy /\ (ld[r].ph = "loading" \/ (ld[r].ph = "loaded" /\ ld[r].pin))   \* load not collected
       \/ Deferred(r)
    /\ LET hold == Deferred(r) /\ Cardinality(HeldReqs) < MaxHeld
           rel == ReleaseTailFirst(table[r]) IN
       /\ status' = [status EXCEPT ![r] = IF hold THEN "held" ELSE "finished"]
       /\ IF Legacy \/ (hold /\ Mutant # "FreeAtFinish")
          THEN UNCHANGED <<ref, free, table>>
          ELSE /\ ref' = rel[1]
               /\ free' = rel[2]
               /\ table' = IF hold THEN table ELSE [table EXCEPT ![r] = <<>>]
       /\ notice' = IF hold THEN notice ELSE [w \in Ranks |-> notice[w] \cup {<<r, gen[r], "finish">>}]
       /\ lastAction' = [name |-> "Finish", r |-> r, g |-> gen[r], held |-> hold]
    /\ UNCHANGED <<gen, ncomp, emitted, ld, nextJob, jobs, fs, content, jp, ws, rep, buf, store, up,
                   faults>>

\* A held request's deferred save was opened (or another request took the model's last job id: the
\* save is given up, a bound of the model as in Finish) and no job of its generation holds a pin any
\* more (every rank reported it, Collect released it): free its table, tail first, and send the finish
\* notice (the runtime: the finish notice with the release flag, then every rank's finished_sending and
\* vLLM's free of the blocks, as one step).
ReleaseHeld(r) ==
    /\ EngineSynced
    /\ status[r] = "held"
    /\ emitted[r] = ncomp[r] \/ nextJob > MaxJobs
    /\ \A j \in PinnedJobs : ~(jobs[j].r = r /\ jobs[j].g = gen[r])
    /\ status' = [status EXCEPT ![r] = "finished"]
    /\ IF Mutant = "FreeAtFinish"     \* freed at Finish already
       THEN UNCHANGED <<ref, free>>
       ELSE LET rel == ReleaseTailFirst(table[r]) IN
              /\ ref' = rel[1]
              /\ free' = rel[2]
    /\ table' = [table EXCEPT ![r] = <<>>]
    /\ notice' = [w \in Ranks |-> notice[w] \cup {<<r, gen[r], "finish">>}]
    /\ lastAction' = [name |-> "ReleaseHeld", r |-> r, g |-> gen[r]]
    /\ UNCHANGED <<gen, ncomp, emitted, ld, nextJob, jobs, fs, content, jp, ws, rep, buf, store, up,
                   faults>>

RepCount(j) == Sum([w \in Ranks |-> rep[w][j]], Ranks)
Reported == {j \in JobIds : RepCount(j) > 0}
LegacyDone == {r \in Req : Legacy /\ status[r] = "finished" /\ fs[r] = Ranks /\ table[r] # <<>>}

\* The free calls of a Collect (for UnrefEach): one per released job, in the order of js, each its
\* pinned blocks tail first (SchedulerLedger.collect calls free(reversed(blocks + tail)) per job); legacy:
\* one per delay-freed request table, tail first.
RECURSIVE JobFrees(_)
JobFrees(js) == IF js = <<>> THEN <<>> ELSE <<Reverse(PinSeq(jobs[Head(js)]))>> \o JobFrees(Tail(js))
RECURSIVE TableFrees(_)
TableFrees(rs) == IF rs = {} THEN <<>>
                  ELSE LET r == CHOOSE r \in rs : TRUE IN <<Reverse(table[r])>> \o TableFrees(rs \ {r})

\* Consume the merged worker reports (completed_saves summed over ranks).  A job whose ranks_left
\* reaches 0 is released: its pins drop tail first, every rank's copy moves to "released".
\* CollectTaken(tk): the scheduler consumes the reports tk[w][j] (those that reached it in this step's
\* worker outputs).  The model's Collect takes every pending report; TraceRuntime takes the logged ones.
CollectPlan(tk) ==
    LET cnt == [j \in JobIds |-> Sum([w \in Ranks |-> tk[w][j]], Ranks)]
        got == {j \in JobIds : cnt[j] > 0}
        newLeft == [j \in JobIds |-> IF Legacy THEN 0 ELSE jobs[j].left - cnt[j]]
    IN [got |-> got, newLeft |-> newLeft, done |-> {j \in got : Legacy \/ newLeft[j] <= 0}]

CollectDo(tk, p) ==
    /\ LET relCalls == IF Legacy \/ Mutant = "NoPin" THEN <<>> ELSE JobFrees(SortedSeq(p.done))
           rel == UnrefEach(relCalls \o TableFrees(LegacyDone), ref, free)
       \* a released job keeps only its owner and generation (its pins are gone)
       IN /\ jobs' = [j \in JobIds |-> IF j \in p.done THEN [NoJob EXCEPT !.r = jobs[j].r, !.g = jobs[j].g]
                                       ELSE IF j \in p.got THEN [jobs[j] EXCEPT !.left = p.newLeft[j]]
                                       ELSE jobs[j]]
          /\ jp' = [w \in Ranks |-> [j \in JobIds |-> IF j \in p.done THEN "released" ELSE jp[w][j]]]
          /\ ref' = rel[1]
          /\ free' = rel[2]
          /\ table' = [r \in Req |-> IF r \in LegacyDone THEN <<>> ELSE table[r]]
          /\ lastAction' = [name |-> "Collect", released |-> p.done, freed |-> LegacyDone]
    /\ rep' = [w \in Ranks |-> [j \in JobIds |-> rep[w][j] - tk[w][j]]]
    /\ UNCHANGED <<status, gen, ncomp, emitted, ld, nextJob, fs, content, ws, notice, buf, store, up,
                   faults>>

\* The plan is bound once: TLC 2.15 re-evaluates an action's LET definitions for every j of the
\* function constructors above (O(ranks^2 x jobs^2) per Collect); bound by \E it is computed once.
\* (As an operator argument it would be re-evaluated under ENABLED, which caches nothing.)
CollectTaken(tk) == \E p \in {CollectPlan(tk)} : CollectDo(tk, p)

Collect ==
    /\ Reported # {} \/ LegacyDone # {}
    /\ CollectTaken(rep)

-----------------------------------------------------------------------------
(* Worker rank w *)
Keyed == Legacy \/ Mutant = "KeyedByReqId"   \* the worker ledger knows req_id only, not generations

\* Register the job in its generation's StoreRequestState, then enqueue it (jobs arrive in id order).
Register(s, j) ==
    LET g == jobs[j].g IN
    CASE Legacy -> [s EXCEPT !.n = @ + 1, !.g = Max2(@, g),
                             !.phase = IF g > s.g THEN "open" ELSE @]
      [] Mutant = "KeyedByReqId" -> [s EXCEPT !.live = @ \cup {j}, !.g = Max2(@, g),
                                              !.phase = IF g > s.g THEN "open" ELSE @]
      [] g > s.g -> [Fresh(g, "open") EXCEPT !.live = {j}]       \* a new generation: fresh state
      [] g = s.g /\ s.phase = "open" -> [s EXCEPT !.live = @ \cup {j}]
      [] OTHER -> s                                              \* generation gone: the job is stale

\* Each worker action has a per-job (per-notice) form: the model quantifies over it; TraceRuntime names
\* the job (notice) the log gives, so checking a long log does not quantify over every job id.
ReceiveJob(w, j) ==
      /\ jp[w][j] = "emitted"
      /\ \A i \in JobIds : i < j => jp[w][i] # "emitted"
      /\ ws' = [ws EXCEPT ![w][jobs[j].r] = Register(@, j)]
      /\ jp' = [jp EXCEPT ![w][j] = "queued"]
      /\ lastAction' = [name |-> "Receive", w |-> w, job |-> j, r |-> jobs[j].r, g |-> jobs[j].g]
      /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free,
                     rep, notice, buf, store, up, faults>>
Receive(w) == \E j \in JobIds : ReceiveJob(w, j)

\* A preemption/finish notice.  It may arrive late (after the next generation's jobs), never before
\* the jobs of its own generation (the metadata stream is ordered).
DropState(s, g, kind) ==
    IF Legacy THEN
        IF kind = "finish" THEN [s EXCEPT !.phase = IF s.n = 0 THEN "closed" ELSE "closing"] ELSE s
    ELSE IF Mutant = "KeyedByReqId" THEN
        [s EXCEPT !.live = IF kind = "preempt" THEN {} ELSE @,
                  !.phase = IF kind = "finish" /\ s.live # {} THEN "closing" ELSE "closed"]
    ELSE CASE s.g > g -> s                                     \* late notice of an older generation
           [] s.g < g -> Fresh(g, "closed")                    \* none of its jobs registered here
           [] kind = "preempt" \/ s.live = {} -> [s EXCEPT !.live = {}, !.phase = "closed"]
           [] OTHER -> [s EXCEPT !.phase = "closing"]

DropNotice(w, nt) ==
      LET r == nt[1]  g == nt[2]  kind == nt[3] IN
      /\ nt \in notice[w]
      /\ \A j \in JobIds : ~(jp[w][j] = "emitted" /\ jobs[j].r = r /\ jobs[j].g = g)
      /\ notice' = [notice EXCEPT ![w] = @ \ {nt}]
      /\ ws' = [ws EXCEPT ![w][r] = DropState(@, g, kind)]
      /\ fs' = IF Legacy /\ kind = "finish" /\ ws[w][r].n = 0 THEN [fs EXCEPT ![r] = @ \cup {w}] ELSE fs
      /\ lastAction' = [name |-> "DropGeneration", w |-> w, r |-> r, g |-> g, kind |-> kind]
      /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, ref, content, free, jp,
                     rep, buf, store, up, faults>>
DropGeneration(w) == \E nt \in notice[w] : DropNotice(w, nt)

Idle(w) == \A j \in JobIds : jp[w][j] \notin BusyPhases
Live(w, j) == Legacy \/ j \in ws[w][jobs[j].r].live

\* The store thread takes the oldest queued job: a stale job runs nothing, a pressure-skipped request's
\* job does nothing, a live one reads its blocks (from the rank's own saved offset) into buf[w].
DmaReadJob(w, j) ==
    /\ Idle(w)
    /\ jp[w][j] = "queued"
    /\ \A i \in JobIds : i < j => jp[w][i] # "queued"
    /\ LET s == ws[w][jobs[j].r]
           from == IF Legacy THEN jobs[j].lo ELSE s.off + 1
           read == {<<c, content[JobBlock(j, c)]>> : c \in from..jobs[j].hi}
           out == IF ~Live(w, j) THEN {"stale"}
                  ELSE IF s.skip THEN {"skipped"}
                  ELSE {"running"} \cup (IF Fault("dma") THEN {"failed"} ELSE {}) IN
       \E o \in out :
         /\ jp' = [jp EXCEPT ![w][j] = o]
         /\ buf' = [buf EXCEPT ![w] = IF o = "running" THEN read ELSE {}]
         /\ faults' = IF o = "failed" THEN faults + 1 ELSE faults
         /\ lastAction' = [name |-> "DmaRead", w |-> w, job |-> j, outcome |-> o]
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free, ws,
                   rep, notice, store, up>>
DmaRead(w) == \E j \in JobIds : DmaReadJob(w, j)

\* Where a stored job moves the rank's saved offset: its last chunk, or the chunk before a partial tail
\* (the tail has its own key; a job reaching a block boundary saves that block whole).
SavedTo(j) == IF jobs[j].tail # 0 THEN jobs[j].hi - 1 ELSE jobs[j].hi

\* The ranks in a fixed order (TLC's CHOOSE is deterministic); with Stripe, chunk c's key is put by
\* Owner(c), the rank at (c - 1) mod |Ranks| in it: kvledger.put_positions(.., replica, replicas) with
\* block position c - 1 and the rank's index as its replica.
RankList == CHOOSE s \in [1..Cardinality(Ranks) -> Ranks] : Range(s) = Ranks
Owner(c) == RankList[((c - 1) % Cardinality(Ranks)) + 1]
Puts(w, c) == ~Stripe \/ Owner(c) = w

PutKeys(w, r, rd) == [k \in Keys |-> IF k[1] = r /\ store[k] = NoContent /\ Puts(w, k[2]) /\ \E p \in rd : p[1] = k[2]
                                  THEN (CHOOSE p \in rd : p[1] = k[2])[2]
                                  ELSE store[k]]

\* Put every read chunk this rank puts (first writer wins; with Stripe only the chunks it owns).  ok moves
\* the saved offset, pressure sets the skip flag, fail changes nothing; only a job still live in its
\* generation may touch the request state.
PutJob(w, j) ==
      /\ jp[w][j] = "running"
      /\ LET r == jobs[j].r
             s == ws[w][r]
             \* Stripe, every read chunk another rank's: nothing of its own to put, no store call, so nothing
             \* can fail (WorkerSteps.put of no key).  (Only with Stripe: the runtime trace check's jobs read
             \* no chunk, and there a put fails as the store made it.)
             outs == IF Stripe /\ \A p \in buf[w] : ~Puts(w, p[1]) THEN {"ok"} ELSE
                     (IF up THEN {"ok"} ELSE {"fail"}) \cup
                     (IF Fault("put") /\ up THEN {"fail"} ELSE {}) \cup
                     (IF Fault("pressure") /\ up THEN {"pressure"} ELSE {}) IN
         \E o \in outs :
           /\ store' = IF o = "ok" THEN PutKeys(w, r, buf[w]) ELSE store
           /\ ws' = IF ~Live(w, j) \/ o = "fail" THEN ws
                    ELSE IF o = "ok" THEN [ws EXCEPT ![w][r].off = Max2(@, SavedTo(j))]
                    ELSE [ws EXCEPT ![w][r].skip = TRUE]
           /\ jp' = [jp EXCEPT ![w][j] = IF o = "ok" THEN "stored" ELSE "failed"]
           /\ faults' = IF up /\ o # "ok" THEN faults + 1 ELSE faults
           /\ lastAction' = [name |-> "Put", w |-> w, job |-> j, outcome |-> o]
      /\ buf' = [buf EXCEPT ![w] = {}]
      /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free,
                     rep, notice, up>>
Put(w) == \E j \in JobIds : PutJob(w, j)

\* Every exit path reports the job exactly once (the one `finally`).
ReportState(s, j) ==
    IF Legacy THEN [s EXCEPT !.n = @ - 1,
                             !.phase = IF @ = "closing" /\ s.n - 1 = 0 THEN "closed" ELSE @]
    ELSE IF j \notin s.live THEN s
    ELSE [s EXCEPT !.live = @ \ {j},
                   !.phase = IF @ = "closing" /\ s.live = {j} THEN "closed" ELSE @]

ReportJob(w, j) ==
      /\ jp[w][j] \in {"stored", "failed", "stale", "skipped"}
      /\ LET r == jobs[j].r IN
         /\ rep' = [rep EXCEPT ![w][j] = @ + IF Mutant = "ReportTwice" /\ jp[w][j] = "failed" THEN 2 ELSE 1]
         /\ ws' = [ws EXCEPT ![w][r] = ReportState(@, j)]
         /\ fs' = IF Legacy /\ ws[w][r].phase = "closing" /\ ws[w][r].n = 1
                  THEN [fs EXCEPT ![r] = @ \cup {w}] ELSE fs
         /\ jp' = [jp EXCEPT ![w][j] = "reported"]
         /\ lastAction' = [name |-> "Report", w |-> w, job |-> j, from |-> jp[w][j]]
      /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, ref, content, free,
                     notice, buf, store, up, faults>>
Report(w) == \E j \in JobIds : ReportJob(w, j)

\* Load one sub-batch of request r's keys on rank w.  A key loads when the store has it; a batch may
\* also fail in transfer (a fault).  Fixed: every key not loaded is reported (ld[r].bad).  Legacy:
\* after a failing sub-batch, the remaining keys are neither loaded nor reported ("skip").
Load(w, r) ==
    /\ ld[r].ph = "loading"
    /\ \E i \in DOMAIN ld[r].st[w] : ld[r].st[w][i] = "pending"
    /\ LET st == ld[r].st[w]
           i0 == Min({i \in DOMAIN st : st[i] = "pending"})
           batch == i0..Min({i0 + SubBatch - 1, ld[r].n})
           keyOK(i) == up /\ store[<<r, i>>] # NoContent IN
       \E xfail \in (IF Fault("load") THEN {FALSE, TRUE} ELSE {FALSE}) :
         LET res == [i \in DOMAIN st |-> IF i \in batch THEN (IF keyOK(i) /\ ~xfail THEN "ok" ELSE "fail")
                                         ELSE st[i]]
             failed == {i \in batch : res[i] = "fail"}
             res2 == IF Legacy /\ failed # {}
                     THEN [i \in DOMAIN res |-> IF res[i] = "pending" THEN "skip" ELSE res[i]]
                     ELSE res
             okKeys == {i \in batch : res[i] = "ok"}
             st2 == [ld[r].st EXCEPT ![w] = res2]
             allDone == \A v \in Ranks : \A i \in DOMAIN st2[v] : st2[v][i] # "pending"
             dst == ld[r].dst
             \* mutant: the pin is dropped when the first rank finished its part of the load
             early == Mutant = "LoadPinFirstRank" /\ ld[r].pin /\ \A i \in DOMAIN res2 : res2[i] # "pending"
             rel == ReleaseTailFirst(dst) IN
         /\ content' = [b \in Blocks |-> IF \E i \in okKeys : dst[i] = b
                                         THEN store[<<r, CHOOSE i \in okKeys : dst[i] = b>>]
                                         ELSE content[b]]
         /\ ld' = [ld EXCEPT ![r].st = st2, ![r].bad = @ \cup failed,
                             ![r].ph = IF allDone THEN "loaded" ELSE "loading",
                             ![r].pin = @ /\ ~early]
         /\ ref' = IF early THEN rel[1] ELSE ref
         /\ free' = IF early THEN rel[2] ELSE free
         /\ faults' = IF xfail THEN faults + 1 ELSE faults
         /\ lastAction' = [name |-> "Load", w |-> w, r |-> r, keys |-> batch, failed |-> failed]
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, nextJob, jobs, fs, jp, ws, rep,
                   notice, buf, store, up>>

-----------------------------------------------------------------------------
(* Store / environment *)
Evict(k) ==
    /\ Fault("evict") /\ store[k] # NoContent
    /\ store' = [store EXCEPT ![k] = NoContent]
    /\ faults' = faults + 1
    /\ lastAction' = [name |-> "Evict", k |-> k]
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free, jp,
                   ws, rep, notice, buf, up>>

StoreFail ==
    /\ Fault("fail") /\ up
    /\ up' = FALSE
    /\ faults' = faults + 1
    /\ lastAction' = [name |-> "StoreFail"]
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free, jp,
                   ws, rep, notice, buf, store>>

StoreRestart ==
    /\ ~up
    /\ up' = TRUE
    /\ store' = [k \in Keys |-> NoContent]   \* the master lost every key
    /\ lastAction' = [name |-> "StoreRestart"]
    /\ UNCHANGED <<status, gen, table, ncomp, emitted, ld, nextJob, jobs, fs, ref, content, free, jp,
                   ws, rep, notice, buf, faults>>

\* Everything finished and drained: the system rests here (not a deadlock).
Terminated ==
    /\ \A r \in Req : status[r] = "finished" /\ table[r] = <<>>
    /\ \A w \in Ranks : notice[w] = {} /\ \A j \in JobIds : jp[w][j] \in {"none", "released"}
    /\ \A r \in Req : ~ld[r].pin
Rest == Terminated /\ UNCHANGED vars

SchedNext == \E r \in Req : Admit(r) \/ Lookup(r) \/ EmitLoad(r) \/ CollectLoad(r) \/ HandleLoadErrors(r)
                            \/ Compute(r)
                            \/ EmitStore(r) \/ Preempt(r) \/ Finish(r) \/ ReleaseHeld(r)
WorkerNext(w) == Receive(w) \/ DropGeneration(w) \/ DmaRead(w) \/ Put(w) \/ Report(w)
                 \/ \E r \in Req : Load(w, r)
EnvNext == (\E k \in Keys : Evict(k)) \/ StoreFail \/ StoreRestart

Next == SchedNext \/ Collect \/ (\E w \in Ranks : WorkerNext(w)) \/ EnvNext \/ Rest

(***************************************************************************)
(* Fairness, and why each is needed:                                       *)
(*  - WF on every worker's actions and on Collect: the worker threads and the*)
(*    engine's step loop keep running while work is pending (vLLM keeps    *)
(*    stepping while has_pending_push_work()); without it a pin could be   *)
(*    held forever by a thread that simply never runs.                     *)
(*  - WF on Admit/Lookup/EmitLoad/CollectLoad/HandleLoadErrors/Compute/    *)
(*    EmitStore/Finish/ReleaseHeld per request: the scheduler schedules    *)
(*    every runnable request (and collects every finished load) and        *)
(*    releases a held request once its deferred save is done.              *)
(*  - StoreRestart is weakly fair: a failed master comes back (operators   *)
(*    restart it).  No fairness for Preempt, Evict, StoreFail: the         *)
(*    adversary may use them, each bounded (MaxGen, MaxFaults).            *)
(* Weak (not strong) fairness suffices: each of these actions stays        *)
(* enabled until taken (EmitStore at the cap is disabled, but the pins     *)
(* that block it are released under WF of the workers and Collect, after   *)
(* which it stays enabled; so is ReleaseHeld until its request's last      *)
(* job is released).                                                       *)
(***************************************************************************)
\* Fairness per process (fewer conjuncts keep TLC's liveness check fast): each rank, the engine's
\* Collect, each request's scheduling and the store master.  A rank's steps all make progress through
\* a finite pipeline, so weak fairness of their disjunction gets every pending step taken.
SchedFair(r) == Admit(r) \/ Lookup(r) \/ EmitLoad(r) \/ CollectLoad(r) \/ HandleLoadErrors(r) \/ Compute(r)
                \/ EmitStore(r) \/ Finish(r) \/ ReleaseHeld(r)
Fairness ==
    /\ \A w \in Ranks : WF_vars(WorkerNext(w))
    /\ WF_vars(Collect)
    /\ \A r \in Req : WF_vars(SchedFair(r))
    /\ WF_vars(StoreRestart)

\* For the exported conformance graph: at most one request is ever preempted (keeps it small).
OnePreemption == Cardinality({r \in Req : gen[r] > 1 \/ status[r] = "preempted"}) <= 1

Spec == Init /\ [][Next]_vars
RankSymmetry == Permutations(Ranks)
FairSpec == Spec /\ Fairness

-----------------------------------------------------------------------------
(* Invariants S1-S9 (spec/README.md) *)
TypeOK ==
    /\ status \in [Req -> {"waiting", "running", "preempted", "held", "finished"}]
    /\ nextJob \in 1..MaxJobs + 1
    /\ \A b \in Blocks : ref[b] \in Nat /\ content[b] \in Content
    /\ \A j \in JobIds : jobs[j].tail \in Blocks \cup {0}
    /\ \A w \in Ranks : \A j \in JobIds : jp[w][j] \in StoreJob_States \cup {"none"}
    /\ \A w \in Ranks : \A r \in Req : ws[w][r].phase \in StoreRequest_States
    /\ \A k \in Keys : store[k] \in Content

\* S1: every key in the store holds the content that belongs to that key.
NoPollution == \A k \in Keys : store[k] \in {NoContent, k}

\* S2: a DMA read only reads blocks that are pinned by the job and still hold the job's content.
DmaReadsPinned ==
    \A w \in Ranks : \A j \in JobIds : jp[w][j] = "running" =>
        /\ Pinned(j)
        /\ \A p \in buf[w] : /\ p[2] = <<jobs[j].r, p[1]>>
                             /\ content[JobBlock(j, p[1])] = p[2]

\* S3: a block's ref count equals its holders (request tables + pinned jobs); free <=> ref = 0.
Holders(b) == Cardinality({r \in Req : b \in Range(table[r])})
              + Cardinality({j \in PinnedJobs : b \in Range(PinSeq(jobs[j]))})
              + Cardinality({r \in Req : ld[r].pin /\ b \in Range(ld[r].dst)})
RefCountExact ==
    /\ \A b \in Blocks : ref[b] = Holders(b) /\ (ref[b] = 0 <=> b \in Range(free))
    /\ Len(free) = Cardinality(Range(free))

\* S4: a step by a job of an old generation never changes the live set, offset, pressure flag (or
\* legacy counter) of a newer generation's request state.  An action property: TLC names it when
\* violated (exit 13, "Action property NoStaleEffect is violated").
StaleStep(w, r) ==
    LET s == ws[w][r]  t == ws'[w][r]  j == lastAction'.job IN
    (t.g = s.g /\ jobs[j].g < s.g) => <<t.live, t.off, t.skip, t.n>> = <<s.live, s.off, s.skip, s.n>>
NoStaleEffect == [][("job" \in DOMAIN lastAction' /\ lastAction'.name # "EmitStore")
                    => \A w \in Ranks : \A r \in Req : StaleStep(w, r)]_vars

\* S5: each rank reports each job at most once; ranks_left never below 0 nor below the ranks that
\* still have to report.
ReportedOnce ==
    \A j \in JobIds :
        /\ jobs[j].left >= 0
        /\ \A w \in Ranks : rep[w][j] <= 1
        /\ ~Legacy /\ j < nextJob =>
             jobs[j].left >= Cardinality({w \in Ranks : jp[w][j] \in OpenPhases})

\* S6: pinned jobs (hence pinned blocks) never exceed the cap.
BoundedPins == Cardinality(PinnedJobs) <= PinCap

\* S7: every chunk the scheduler counts as computed (incl. loaded ones) holds the request's content.
NoGarbageCompute == \A r \in Req : status[r] = "running" => \A i \in 1..ncomp[r] : content[table[r][i]] = <<r, i>>

\* S8: when a load finishes, every attempted key that did not load on some rank was reported.
LoadErrorsReported == \A r \in Req : ld[r].ph = "loaded" =>
    {i \in 1..ld[r].n : \E w \in Ranks : ld[r].st[w][i] # "ok"} \subseteq ld[r].bad

\* S9: no load writes into a block that is not pinned for it: while a rank still has keys of r's load to
\* write, the load holds its pin, and no destination block is free or in another request's table.
LoadsPinned == \A r \in Req : ld[r].ph = "loading" /\ LoadPending(r) =>
    /\ ld[r].pin
    /\ \A b \in Range(ld[r].dst) : /\ b \notin Range(free)
                                  /\ \A q \in Req \ {r} : b \notin Range(table[q])

\* Every phase change is a transition of spec/machines.json, triggered by the step's action.
JobPhaseStep(w, j) ==
    jp'[w][j] # jp[w][j] =>
        \/ <<jp[w][j], jp'[w][j], lastAction'.name>> \in StoreJob_Transitions
        \/ <<jp[w][j], jp'[w][j], lastAction'.name>> = <<"none", StoreJob_Initial, "EmitStore">>
ReqPhaseStep(w, r) ==
    LET s == ws[w][r]  t == ws'[w][r] IN
    IF t.g = s.g
    THEN t.phase # s.phase => <<s.phase, t.phase, lastAction'.name>> \in StoreRequest_Transitions
    ELSE \/ t.phase = StoreRequest_Initial     \* a fresh StoreRequestState for a new generation
         \/ <<StoreRequest_Initial, t.phase, lastAction'.name>> \in StoreRequest_Transitions
LifecycleConforms ==
    [][\A w \in Ranks : (\A j \in JobIds : JobPhaseStep(w, j)) /\ (\A r \in Req : ReqPhaseStep(w, r))]_vars

-----------------------------------------------------------------------------
(* Liveness (checked under FairSpec) *)
PinsReleased == \A j \in JobIds : Pinned(j) ~> ~Pinned(j)
AllFinished == \A r \in Req : status[r] = "finished"
AllFree == Len(free) = NumBlocks /\ PinnedJobs = {}
NoLeakAtRest == AllFinished ~> AllFree
LoadsFinish == \A r \in Req : ld[r].ph = "loading" ~> ld[r].ph = "done"
Progress == \A r \in Req : status[r] = "running" ~> status[r] = "finished"
\* A held request is released: its deferred save runs and its blocks are freed.
HeldReleased == \A r \in Req : status[r] = "held" ~> status[r] = "finished"
=============================================================================
