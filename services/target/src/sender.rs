//! The sender: streams host batches to the drafter as chunks, within the
//! credits the drafter grants, keeps every unacknowledged batch, and
//! replays them after a reconnect (a restarted drafter included).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use dflash_proto as pb;
use dflash_proto::drafter_message::Msg;
use dflash_role::{KindExt, Session, with_timeout};
use dflash_telemetry::ErrorKind;
use dflash_wire::rpc::{open_hidden_state_stream, transport};
use dflash_wire::{HostBatch, batch_messages};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::postprocess::OutboundBatch;

/// Why one connection to the drafter ended.
enum StreamEnd {
    /// Reconnect (drafter gone, endpoint changed, stream broken).
    Reconnect(String),
    /// The role is stopping.
    Stopped,
}

/// When a drafter that owes acknowledgements has been quiet too long
/// (`faults.ack_timeout_ms`): the clock runs from the last
/// acknowledgement, or from the send that left it owing after it owed
/// nothing. A drafter that stops acknowledging without ending the stream
/// (its process alive, keepalives answered) would otherwise hold this
/// stream's batches for good.
struct AckWatch {
    timeout: Duration,
    since: Option<Instant>,
}

impl AckWatch {
    fn new(timeout: Duration) -> Self {
        Self { timeout, since: None }
    }

    /// A batch went out.
    fn sent(&mut self, now: Instant) {
        self.since.get_or_insert(now);
    }

    /// An acknowledgement came; `outstanding` batches are still owed.
    fn acked(&mut self, now: Instant, outstanding: usize) {
        self.since = (outstanding > 0).then_some(now);
    }

    /// When the stream is to be given up, while anything is owed.
    fn deadline(&self) -> Option<Instant> {
        self.since.map(|s| s + self.timeout)
    }
}

/// One stream to the drafter. A target runs `pipeline.streams_per_target`
/// of them side by side, all taking batches from the same queue, so that
/// one stream's per-connection limit does not cap what a GPU produces.
pub struct Sender {
    pub session: Arc<Session>,
    pub input: flume::Receiver<OutboundBatch>,
    pub drafter_endpoint: watch::Receiver<Option<String>>,
    /// This stream's share of the target's in-flight limit.
    window: usize,
    /// Unacknowledged batches with their leases, oldest first (at most `window`).
    unacked: VecDeque<OutboundBatch>,
    reports: mpsc::Sender<(u64, String)>,
    /// `stream-<i>`, for metrics.
    label: String,
    /// The current stream got the drafter's welcome (backoff resets).
    welcomed: bool,
}

/// Starts the task that reports acknowledged batches to the coordinator;
/// every stream of a target shares it.
pub fn spawn_reporter(session: Arc<Session>, stages: &dflash_role::Stages) -> mpsc::Sender<(u64, String)> {
    let (reports, rx) = mpsc::channel(256);
    stages.spawn_task("report-sent", async move {
        report_sent(session, rx).await;
        Ok(())
    });
    reports
}

impl Sender {
    pub fn new(
        session: Arc<Session>,
        input: flume::Receiver<OutboundBatch>,
        drafter_endpoint: watch::Receiver<Option<String>>,
        window: usize,
        reports: mpsc::Sender<(u64, String)>,
        index: usize,
    ) -> Self {
        Self {
            session,
            input,
            drafter_endpoint,
            window: window.max(1),
            unacked: VecDeque::new(),
            reports,
            label: format!("stream-{index}"),
            welcomed: false,
        }
    }

    /// Runs until the role stops.
    pub async fn run(mut self) -> anyhow::Result<()> {
        let stop = self.session.stop.clone();
        let mut backoff = dflash_role::Backoff::new();
        loop {
            // The route closed: the member left the group.
            if self.drafter_endpoint.has_changed().is_err() {
                return Ok(());
            }
            // Wait for a drafter to exist.
            let endpoint = loop {
                if let Some(e) = self.drafter_endpoint.borrow_and_update().clone() {
                    break e;
                }
                tokio::select! {
                    r = self.drafter_endpoint.changed() => if r.is_err() { return Ok(()) },
                    _ = stop.stopped() => return Ok(()),
                }
            };
            match self.connection(&endpoint).await? {
                StreamEnd::Stopped => return Ok(()),
                StreamEnd::Reconnect(why) => {
                    if std::mem::take(&mut self.welcomed) {
                        // The stream worked: the next wait starts short.
                        backoff.reset();
                    }
                    let bytes: usize = self.unacked.iter().map(|o| o.batch.payload.len()).sum();
                    dflash_telemetry::metrics().errors.with_label_values(&[ErrorKind::Transport.label()]).inc();
                    tracing::warn!(
                        "stream to drafter {endpoint} ended ({why}); {} unacknowledged batch(es), {:.1} MiB, kept for replay",
                        self.unacked.len(),
                        bytes as f64 / (1 << 20) as f64
                    );
                    tokio::select! {
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                        r = self.drafter_endpoint.changed() => if r.is_err() { return Ok(()) },
                        _ = stop.stopped() => return Ok(()),
                    }
                }
            }
        }
    }

    /// One stream to one drafter: hello, replay, then send and handle acks.
    async fn connection(&mut self, endpoint: &str) -> anyhow::Result<StreamEnd> {
        let stop = self.session.stop.clone();
        let ep = transport::data_endpoint(endpoint)
            .map_err(anyhow::Error::msg)
            .and_then(|e| self.session.security.endpoint(e));
        let channel = match ep.kind(ErrorKind::Config)?.connect().await {
            Ok(c) => c,
            Err(e) => return Ok(StreamEnd::Reconnect(format!("connect: {e}"))),
        };
        let (tx, rx) = mpsc::channel::<pb::TargetMessage>(16);
        let hello = pb::TargetMessage {
            msg: Some(pb::target_message::Msg::Hello(pb::StreamHello {
                protocol_version: dflash_proto::PROTOCOL_VERSION,
                run_id: self.session.run_id.clone(),
                target_instance: self.session.instance_id.clone(),
            })),
        };
        tx.send(hello).await.ok();
        let mut responses = match with_timeout(
            self.session.rpc_timeout(),
            open_hidden_state_stream(channel, self.session.security.client_auth(), rx),
        )
        .await
        {
            Ok(s) => s,
            Err(s) => return refused_or_retry(endpoint, &s),
        };
        let welcome = match tokio::time::timeout(self.session.rpc_timeout(), responses.message()).await {
            Ok(Ok(Some(pb::DrafterMessage { msg: Some(Msg::Welcome(w)) }))) => w,
            Ok(Err(s)) => return refused_or_retry(endpoint, &s),
            other => return Ok(StreamEnd::Reconnect(format!("no welcome from the drafter: {other:?}"))),
        };
        self.welcomed = true;
        let credits = (welcome.credits.max(1) as usize).min(self.window);
        let drafter = welcome.drafter_instance;
        let chunk = self.session.config.pipeline.chunk_bytes as usize;
        tracing::info!("streaming to drafter {drafter} at {endpoint} ({credits} credits)");
        // Replay what the previous drafter (or connection) never acknowledged.
        let replay: Vec<HostBatch> = self.unacked.iter().map(|o| o.batch.clone()).collect();
        if !replay.is_empty() {
            tracing::info!("replaying {} unacknowledged batch(es) to {drafter}", replay.len());
        }
        let mut ack_watch = AckWatch::new(Duration::from_millis(self.session.config.faults.ack_timeout_ms));
        for b in &replay {
            if !send_batch(&tx, b, chunk).await {
                return Ok(StreamEnd::Reconnect("stream closed during replay".into()));
            }
            ack_watch.sent(Instant::now());
        }
        // Loop exits (`break`) are the role stopping; reconnects return.
        loop {
            let can_send = self.unacked.len() < credits;
            tokio::select! {
                b = self.input.recv_async(), if can_send => {
                    let Ok(outbound) = b else { break };
                    let ok = send_batch(&tx, &outbound.batch, chunk).await;
                    self.unacked.push_back(outbound);
                    ack_watch.sent(Instant::now());
                    self.export_gauges();
                    if !ok {
                        return Ok(StreamEnd::Reconnect("stream closed while sending".into()));
                    }
                }
                m = responses.message() => match m {
                    Ok(Some(pb::DrafterMessage { msg: Some(Msg::Ack(ack)) })) => {
                        self.handle_ack(ack, &drafter, &tx, chunk).await?;
                        ack_watch.acked(Instant::now(), self.unacked.len());
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => return Ok(StreamEnd::Reconnect("drafter closed the stream".into())),
                    // The drafter ended the stream with a status: the
                    // policy decides (a stall reconnects, a refusal fails).
                    Err(s) => return refused_or_retry(endpoint, &s),
                },
                r = self.drafter_endpoint.changed() => {
                    if r.is_err() { break }
                    if self.drafter_endpoint.borrow().as_deref() != Some(endpoint) {
                        return Ok(StreamEnd::Reconnect("drafter endpoint changed".into()));
                    }
                }
                _ = tokio::time::sleep_until(ack_watch.deadline().unwrap_or_else(Instant::now)), if ack_watch.deadline().is_some() => {
                    return Ok(StreamEnd::Reconnect(format!(
                        "drafter {drafter} acknowledged nothing for {} ms with {} batch(es) outstanding \
                         (faults.ack_timeout_ms)",
                        ack_watch.timeout.as_millis(),
                        self.unacked.len()
                    )));
                }
                _ = stop.stopped() => break,
            }
        }
        close_stream(tx, &mut responses).await;
        Ok(StreamEnd::Stopped)
    }

    fn export_gauges(&self) {
        let m = dflash_telemetry::metrics();
        m.inflight_batches.with_label_values(&[&self.label]).set(self.unacked.len() as i64);
        m.queue_depth.with_label_values(&["send"]).set(self.input.len() as i64);
    }

    async fn handle_ack(
        &mut self,
        ack: pb::BatchAck,
        drafter: &str,
        tx: &mpsc::Sender<pb::TargetMessage>,
        chunk: usize,
    ) -> anyhow::Result<()> {
        let Some(pos) = self.unacked.iter().position(|o| o.batch.meta.batch_id == ack.batch_id) else {
            tracing::warn!("acknowledgement for unknown batch {}", ack.batch_id);
            return Ok(());
        };
        match pb::AckStatus::try_from(ack.status) {
            Ok(pb::AckStatus::Accepted) => {
                // Dropping it gives up its payload and its lease: the
                // drafter owns the batch now.
                let OutboundBatch { batch, .. } = self.unacked.remove(pos).expect("position is valid");
                self.export_gauges();
                let m = dflash_telemetry::metrics();
                m.batches.with_label_values(&["sent"]).inc();
                m.tokens.with_label_values(&["sent"]).inc_by(batch.meta.token_count() as u64);
                let _ = self.reports.send((batch.meta.batch_id, drafter.to_string())).await;
            }
            Ok(pb::AckStatus::Resend) => {
                tracing::warn!("drafter asks to resend batch {}: {}", ack.batch_id, ack.reason);
                dflash_telemetry::metrics().batches.with_label_values(&["resent"]).inc();
                let batch = self.unacked[pos].batch.clone();
                send_batch(tx, &batch, chunk).await;
            }
            _ => {
                // The drafter will never take this batch as it is: drop it
                // (the drafter reports it to the ledger as skipped when it is
                // the plan's batch with bad contents) and go on.
                drop(self.unacked.remove(pos));
                self.export_gauges();
                dflash_telemetry::metrics().batches.with_label_values(&["rejected"]).inc();
                let err = anyhow::anyhow!("drafter rejected batch {}: {}", ack.batch_id, ack.reason);
                tracing::error!("{err}");
                self.session.report_error(ErrorKind::BadBatch, &err).await;
            }
        }
        Ok(())
    }
}

/// What a drafter's status on a stream (at its start or mid-stream) means,
/// by the written policy: a refusal no retry helps fails the target;
/// anything else reconnects with backoff.
fn refused_or_retry(endpoint: &str, s: &tonic::Status) -> anyhow::Result<StreamEnd> {
    let refusal = dflash_proto::DrafterError::from_status(s);
    let fail = s.code() == tonic::Code::Unauthenticated
        || dflash_telemetry::on_drafter_error(refusal.as_ref()) == dflash_telemetry::Reaction::Fail;
    if fail {
        return Err(anyhow::anyhow!("drafter {endpoint} refused the stream: {}", s.message()))
            .kind(ErrorKind::Protocol);
    }
    Ok(StreamEnd::Reconnect(s.message().to_string()))
}

/// Sends one batch's messages; false if the stream is gone. The header
/// carries the send span's context, so the drafter's spans continue it.
async fn send_batch(tx: &mpsc::Sender<pb::TargetMessage>, batch: &HostBatch, chunk: usize) -> bool {
    let span = dflash_telemetry::batch_span("send", &batch.meta.trace_context, batch.meta.batch_id);
    let messages = batch_messages(batch, chunk).with_trace_context(dflash_telemetry::context_of(&span));
    let send = async {
        for m in messages {
            if tx.send(m).await.is_err() {
                return false;
            }
        }
        true
    };
    let ok = tracing::Instrument::instrument(send, span).await;
    if ok {
        dflash_telemetry::metrics().bytes.with_label_values(&["sent"]).inc_by(batch.payload.len() as u64);
    }
    ok
}

/// Tells the coordinator which batches the drafter acknowledged, batching
/// what has accumulated into one call.
async fn report_sent(session: Arc<Session>, mut rx: mpsc::Receiver<(u64, String)>) {
    let mut client = session.client();
    while let Some(first) = rx.recv().await {
        let mut by_drafter: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
        by_drafter.entry(first.1).or_default().push(first.0);
        while let Ok((id, d)) = rx.try_recv() {
            by_drafter.entry(d).or_default().push(id);
        }
        for (drafter_instance, batch_ids) in by_drafter {
            let req = pb::ReportSentRequest {
                run_id: session.run_id.clone(),
                instance_id: session.instance_id.clone(),
                batch_ids,
                drafter_instance,
            };
            if let Err(s) = with_timeout(session.rpc_timeout(), client.report_sent(req)).await {
                // The ledger keeps them leased; their leases lapse and they are redone.
                tracing::warn!("could not report acknowledged batches: {}", s.message());
            }
        }
    }
}

/// How long a stopping target waits for the drafter to end its side of a
/// stream after ending its own.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Ends the request stream (END_STREAM after what is queued) and waits, at
/// most `CLOSE_GRACE`, for the drafter to end the response stream, so that a
/// finished run closes its streams cleanly instead of resetting them when the
/// process exits (which the drafter would report as a broken stream).
async fn close_stream(tx: mpsc::Sender<pb::TargetMessage>, responses: &mut tonic::Streaming<pb::DrafterMessage>) {
    drop(tx);
    let drain = async { while let Ok(Some(_)) = responses.message().await {} };
    let _ = tokio::time::timeout(CLOSE_GRACE, drain).await;
}

#[cfg(test)]
mod tests {
    use dflash_proto::DrafterError;

    use super::*;

    fn ends(status: tonic::Status) -> Result<String, ErrorKind> {
        match refused_or_retry("http://d:1", &status) {
            Ok(StreamEnd::Reconnect(why)) => Ok(why),
            Ok(StreamEnd::Stopped) => panic!("a status never means stopped"),
            Err(e) => Err(dflash_role::kind_of(&e)),
        }
    }

    #[test]
    fn the_ack_watch_runs_from_the_last_acknowledgement_while_anything_is_owed() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut w = AckWatch::new(Duration::from_millis(1000));
        assert_eq!(w.deadline(), None, "nothing owed, no deadline");
        w.sent(at(10));
        w.sent(at(20));
        assert_eq!(w.deadline(), Some(at(1010)), "from the first send that left it owing");
        w.acked(at(500), 1);
        assert_eq!(w.deadline(), Some(at(1500)), "an acknowledgement restarts the clock");
        w.acked(at(600), 0);
        assert_eq!(w.deadline(), None, "all acknowledged");
        w.sent(at(2000));
        assert_eq!(w.deadline(), Some(at(3000)));
    }

    #[test]
    fn a_drafters_status_on_the_stream_reconnects_or_fails_the_target_as_the_policy_says() {
        // Mid-stream or at the start: what no retry helps fails the target.
        for e in [
            DrafterError::MessageTooLarge { len: 9, limit: 8 },
            DrafterError::Malformed("bad frame".into()),
            DrafterError::WrongRun { got: "a".into(), trains: "b".into() },
        ] {
            assert_eq!(ends(e.into()), Err(ErrorKind::Protocol));
        }
        assert_eq!(ends(tonic::Status::unauthenticated("token")), Err(ErrorKind::Protocol));
        // A stall, a full drafter, a stopping one or a broken connection:
        // reconnect (unacknowledged batches are replayed).
        for e in [DrafterError::Stalled { ms: 30 }, DrafterError::TooManyStreams { max: 4 }, DrafterError::Stopping] {
            let why = e.to_string();
            assert_eq!(ends(e.into()), Ok(why));
        }
        assert_eq!(ends(tonic::Status::unknown("h2 protocol error")), Ok("h2 protocol error".into()));
    }
}
