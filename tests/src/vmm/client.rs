//! A host-side client of the agent's probe protocol over the built-in VMM's COM1, with the
//! host TSC of the VM exits that bracket each exchange.

use std::time::{Duration, Instant};

use vmtsync_core::proto::{Feed, FrameReceiver, MAX_FRAME_SIZE, Message, encode_frame};

use super::serial::SerialHost;

/// One request/reply exchange and the host-TSC bracket the VMM measured around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    /// The reply.
    pub reply: Message,
    /// Host TSC at the exit where the guest read the request's last byte (its delimiter): the
    /// guest cannot have acted on the request before this.
    pub request_read_tsc: u64,
    /// Host TSC at the exit where the guest wrote the reply's first byte: anything the guest
    /// put in the reply was read before this.
    pub reply_first_byte_tsc: u64,
    /// Host TSC at the exit just before that one. The agent's probe path polls LSR (an exit),
    /// reads the TSC, and writes the first byte with no exit in between, so for probe replies
    /// `[reply_prev_exit_tsc, reply_first_byte_tsc]` brackets the TSC read tightly.
    pub reply_prev_exit_tsc: u64,
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClientError {
    /// No complete reply frame in time (the guest may have stopped; check its COM2 log).
    #[error("no reply within {0:?} (see the agent's COM2 log)")]
    Timeout(Duration),
    /// The guest's bytes did not decode.
    #[error("the agent sent an undecodable frame: {0}")]
    BadFrame(String),
    /// The request did not fit a frame buffer.
    #[error("the request does not encode: {0}")]
    Encode(String),
}

/// The protocol client. It owns the frame reassembly state of COM1's guest→host direction.
#[derive(Debug)]
pub struct ProtoClient<'a> {
    host: &'a SerialHost,
    rx: FrameReceiver,
}

impl<'a> ProtoClient<'a> {
    /// A client on `host`.
    #[must_use]
    pub fn new(host: &'a SerialHost) -> Self {
        Self {
            host,
            rx: FrameReceiver::new(),
        }
    }

    /// Waits for the agent's ready beacon (a lone `0x00`). Returns whether it came in time.
    #[must_use]
    pub fn wait_ready(&mut self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        while let Some(b) = self
            .host
            .recv_timeout(end.saturating_duration_since(Instant::now()))
        {
            if b.byte == 0 {
                return true;
            }
        }
        false
    }

    /// Sends `msg` and waits at most `timeout` for the next frame from the guest.
    ///
    /// # Errors
    /// [`ClientError`] on timeout, a bad reply frame, or an unencodable request.
    pub fn exchange(&mut self, msg: &Message, timeout: Duration) -> Result<Exchange, ClientError> {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let frame =
            encode_frame(msg, &mut buf).map_err(|e| ClientError::Encode(format!("{e:?}")))?;
        let frame_len = frame.len();
        self.host.send(frame);

        let end = Instant::now() + timeout;
        let mut first_byte = None;
        let reply = loop {
            let left = end.saturating_duration_since(Instant::now());
            let b = self
                .host
                .recv_timeout(left)
                .ok_or(ClientError::Timeout(timeout))?;
            if b.byte != 0 && first_byte.is_none() {
                first_byte = Some(b);
            }
            match self.rx.feed(&[b.byte]) {
                Feed::Consumed => {
                    if b.byte == 0 {
                        // An empty frame (the ready beacon): the next byte starts a frame.
                        first_byte = None;
                    }
                }
                Feed::Message { msg, .. } => break msg,
                Feed::Error { error, .. } => {
                    return Err(ClientError::BadFrame(format!("{error:?}")));
                }
            }
        };
        // The guest read every request byte before answering, so all deliveries are recorded.
        let mut request_read_tsc = 0;
        for _ in 0..frame_len {
            let d = self
                .host
                .delivered_timeout(Duration::from_secs(1))
                .ok_or(ClientError::Timeout(timeout))?;
            request_read_tsc = d.host_tsc;
        }
        let first = first_byte.map_or((0, 0), |b| (b.host_tsc, b.prev_exit_host_tsc));
        Ok(Exchange {
            reply,
            request_read_tsc,
            reply_first_byte_tsc: first.0,
            reply_prev_exit_tsc: first.1,
        })
    }
}
