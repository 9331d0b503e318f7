//! Measures live subscriptions: opens many graphql-transport-ws subscriptions against one
//! `compute-api serve` process, commits events at a steady rate, and prints the commit-to-delivery
//! latency, the deliveries per second and the API process's memory.
//!
//! ```sh
//! cargo build --release -p compute-api -p compute-tests
//! target/release/bench-subscriptions [subscribers] [tenants] [events/s] [seconds]
//! ```
//!
//! Each subscriber is a member of one of `tenants` tenants and subscribes to its tenant's
//! `events`; each event belongs to one tenant, so it reaches `subscribers / tenants` subscribers.
//! Latency runs from just before the committing statement is sent to the moment the subscriber
//! has read the `next` message. The clients run in this process on the same two cores as the API
//! and PostgreSQL. Asserts nothing: a benchmark, not a test.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::io::Write;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use compute_api::auth::Role;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// User plus system CPU seconds of `pid`.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The event number in a `next` message (`"subject":"e<n>"`), without parsing all of it.
fn event_number(text: &[u8]) -> Option<usize> {
    const KEY: &[u8] = b"\"subject\":\"e";
    let at = text.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let digits = text[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&text[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

/// A WebSocket client that does only what this benchmark needs: the upgrade, masked text
/// frames out, and server frames read from one reused buffer. tungstenite's client cost the
/// benchmark a buffer's zeroing, a split of its buffer and an owned message per frame, on the
/// same two cores the API is measured on; this reads each frame where it lies.
struct Client {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
    /// Where the next frame starts in `buf`.
    at: usize,
}

impl Client {
    async fn connect(addr: std::net::SocketAddr) -> Client {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let request = format!(
            "GET /graphql HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Protocol: graphql-transport-ws\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("upgrade");
        let mut buf = Vec::with_capacity(4096);
        let end = loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            assert!(
                stream.read_buf(&mut buf).await.expect("read") > 0,
                "closed during the upgrade"
            );
        };
        assert!(
            buf.starts_with(b"HTTP/1.1 101"),
            "the upgrade was refused: {}",
            String::from_utf8_lossy(&buf[..end])
        );
        Client {
            stream,
            buf,
            at: end,
        }
    }

    /// Sends a text frame, masked (with a zero key, which leaves the payload as it is).
    async fn send_text(&mut self, text: &str) {
        let mut frame = vec![0x81u8];
        match text.len() {
            n if n < 126 => frame.push(0x80 | n as u8),
            n if n <= usize::from(u16::MAX) => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        frame.extend_from_slice(&[0, 0, 0, 0]);
        frame.extend_from_slice(text.as_bytes());
        self.stream.write_all(&frame).await.expect("send");
    }

    /// The next text message's bytes; `None` once the server closed. Answers pings.
    async fn next_text(&mut self) -> Option<&[u8]> {
        loop {
            if let Some((opcode, start, end)) = self.frame() {
                self.at = end;
                match opcode {
                    0x1 => return Some(&self.buf[start..end]),
                    0x8 => return None,
                    0x9 => {
                        let payload = self.buf[start..end].to_vec();
                        let mut pong = vec![0x8a, 0x80 | payload.len() as u8, 0, 0, 0, 0];
                        pong.extend_from_slice(&payload);
                        self.stream.write_all(&pong).await.ok()?;
                    }
                    _ => {}
                }
                continue;
            }
            // Keep the unread part of a frame; read after it, into spare room (not zeroed).
            self.buf.drain(..self.at);
            self.at = 0;
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(4096);
            }
            if self.stream.read_buf(&mut self.buf).await.ok()? == 0 {
                return None;
            }
        }
    }

    /// The opcode and payload range of a whole frame at `at`, if one is there (server frames
    /// are unmasked and, from this server, never fragmented).
    fn frame(&self) -> Option<(u8, usize, usize)> {
        let b = &self.buf[self.at..];
        let (len, header) = match *b.get(1)? & 0x7f {
            126 => (usize::from(u16::from_be_bytes([*b.get(2)?, *b.get(3)?])), 4),
            127 => (
                usize::try_from(u64::from_be_bytes(b.get(2..10)?.try_into().ok()?)).ok()?,
                10,
            ),
            n => (usize::from(n), 2),
        };
        (b.len() >= header + len).then(|| (b[0] & 0x0f, self.at + header, self.at + header + len))
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let subscribers = arg(1, 1000);
    let tenants = arg(2, 100).max(1);
    let rate = arg(3, 100).max(1);
    let seconds = arg(4, 10).max(1);

    let binary = std::env::current_exe()
        .expect("own path")
        .with_file_name("compute-api");
    if !binary.exists() {
        eprintln!(
            "{} is missing: build it first with `cargo build --release -p compute-api -p compute-tests`",
            binary.display()
        );
        std::process::exit(2);
    }
    let test_db = compute_tests::test_db_on_wall_clock_with(4).await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let mut server = tokio::process::Command::new(&binary)
        .args(["serve", "--listen", &addr.to_string()])
        .env("DATABASE_URL", &test_db.url)
        // The transport limits (docs/security.md) default to 1,024 connections and a few streams
        // per identity; this benchmark opens `subscribers` connections for `tenants` identities.
        .env("COMPUTE_MAX_CONNECTIONS", (subscribers + 64).to_string())
        .env("COMPUTE_MAX_STREAMS_PER_IDENTITY", subscribers.to_string())
        .env("COMPUTE_JWT_HS256_SECRET", compute_tests::TEST_SECRET)
        .env("COMPUTE_JWT_ISSUER", compute_tests::TEST_ISSUER)
        .env("COMPUTE_JWT_AUDIENCE", compute_tests::TEST_AUDIENCE)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start compute-api serve");
    let pid = server.id().expect("pid");
    let http = reqwest::Client::new();
    let base = format!("http://{addr}");
    let ready = Instant::now();
    while http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .map(|r| !r.status().is_success())
        .unwrap_or(true)
    {
        assert!(
            ready.elapsed() < Duration::from_secs(30),
            "the API did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let token = |t: usize| {
        compute_tests::mint(compute_tests::claims(
            &format!("bench@t{t}"),
            Some(&format!("t{t}")),
            &[Role::Member],
            3600,
        ))
    };
    let cursor: serde_json::Value = http
        .post(format!("{base}/graphql"))
        .bearer_auth(token(0))
        .json(&json!({ "query": "{ eventCursor }" }))
        .send()
        .await
        .expect("eventCursor")
        .json()
        .await
        .expect("json");
    let cursor = cursor["data"]["eventCursor"].clone();
    let rss_idle = rss_kib(pid);

    let total_events = rate * seconds;
    let start = Instant::now();
    let sent_at: Arc<Vec<AtomicU64>> =
        Arc::new((0..total_events).map(|_| AtomicU64::new(0)).collect());
    let received = Arc::new(AtomicUsize::new(0));
    let connected = Arc::new(AtomicUsize::new(0));
    print!("opening {subscribers} subscriptions over {tenants} tenants … ");
    let _ = std::io::stdout().flush();
    let opened = Instant::now();
    let mut readers = Vec::with_capacity(subscribers);
    let gate = Arc::new(tokio::sync::Semaphore::new(200));
    for i in 0..subscribers {
        let (sent_at, received, connected, gate) = (
            sent_at.clone(),
            received.clone(),
            connected.clone(),
            gate.clone(),
        );
        let token = token(i % tenants);
        let cursor = cursor.clone();
        readers.push(tokio::spawn(async move {
            let permit = gate.acquire_owned().await.expect("gate");
            let mut ws = Client::connect(addr).await;
            ws.send_text(
                &json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })
                    .to_string(),
            )
            .await;
            assert!(
                ws.next_text()
                    .await
                    .is_some_and(|t| t.windows(14).any(|w| w == b"connection_ack")),
                "no connection_ack"
            );
            ws.send_text(
                &json!({ "id": "1", "type": "subscribe", "payload": {
                    "query": "subscription($a: String) { events(after: $a, types: [\"bench.tick\"]) { id subject } }",
                    "variables": { "a": cursor } } })
                .to_string(),
            )
            .await;
            connected.fetch_add(1, Ordering::Relaxed);
            drop(permit);
            let mut latencies = Vec::new();
            while let Some(text) = ws.next_text().await {
                let now = start.elapsed().as_micros() as u64;
                if let Some(n) = event_number(text) {
                    let sent = sent_at[n].load(Ordering::Relaxed);
                    latencies.push((n, now.saturating_sub(sent)));
                    received.fetch_add(1, Ordering::Relaxed);
                }
            }
            latencies
        }));
    }
    while connected.load(Ordering::Relaxed) < subscribers {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_connected = rss_kib(pid);
    println!("{:.1} s", opened.elapsed().as_secs_f64());

    // The writer is a process of the product's kind: its transactions go through `Db::tx`, which
    // pokes the outbox readers after each commit (at most once per 5 ms), as the API and the
    // workers do. The events carry no NOTIFY themselves (migration 0015).
    let writer = compute_domain::db::Db::connect(&test_db.url, &Default::default())
        .await
        .expect("writer");
    let per_tenant: Vec<usize> = (0..tenants)
        .map(|t| (0..subscribers).filter(|i| i % tenants == t).count())
        .collect();
    let expected: usize = (0..total_events).map(|n| per_tenant[n % tenants]).sum();
    println!(
        "committing {total_events} events at {rate}/s for {seconds} s; {expected} deliveries expected"
    );
    let cpu_before = cpu_seconds(pid);
    let mut rss_peak = rss_connected;
    let emit_started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    for n in 0..total_events {
        tick.tick().await;
        sent_at[n].store(start.elapsed().as_micros() as u64, Ordering::Relaxed);
        let (tenant, subject) = (format!("t{}", n % tenants), format!("e{n}"));
        writer
            .tx("bench_emit", compute_domain::db::TxKind::Write, |c| {
                let (tenant, subject) = (tenant.clone(), subject.clone());
                Box::pin(async move {
                    sqlx::query("SELECT compute_emit('bench.tick', $1, $2, '{}')")
                        .bind(tenant)
                        .bind(subject)
                        .execute(&mut *c)
                        .await?;
                    Ok(())
                })
            })
            .await
            .expect("emit");
        if n % rate == 0 {
            rss_peak = rss_peak.max(rss_kib(pid));
        }
    }
    let emitted = emit_started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(30);
    while received.load(Ordering::Relaxed) < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
        rss_peak = rss_peak.max(rss_kib(pid));
    }
    let delivered_in = emit_started.elapsed();
    let cpu = cpu_seconds(pid) - cpu_before;
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .unwrap_or_default();
    let fallbacks = metrics
        .lines()
        .find_map(|l| l.strip_prefix("compute_subscription_fallbacks_total "))
        .unwrap_or("?")
        .to_owned();
    let _ = server.start_kill();
    let _ = server.wait().await;
    let mut by_event: Vec<(usize, u64)> = Vec::with_capacity(expected);
    for r in readers {
        if let Ok(l) = r.await {
            by_event.extend(l);
        }
    }
    let mut latencies: Vec<u64> = by_event.iter().map(|(_, l)| *l).collect();
    latencies.sort_unstable();
    // The worst second tells a steady cost from a periodic one.
    let mut per_second: Vec<Vec<u64>> = vec![Vec::new(); seconds];
    for (n, l) in &by_event {
        per_second[(n / rate).min(seconds - 1)].push(*l);
    }
    let got = latencies.len();
    let ms = |us: u64| us as f64 / 1000.0;
    println!(
        "subscribers        {subscribers} ({} per tenant)",
        subscribers / tenants
    );
    println!(
        "events committed   {total_events} in {:.2} s ({:.0}/s)",
        emitted.as_secs_f64(),
        total_events as f64 / emitted.as_secs_f64()
    );
    println!(
        "deliveries         {got} of {expected} expected, {:.0}/s",
        got as f64 / delivered_in.as_secs_f64()
    );
    println!(
        "latency ms         p50 {:.1}  p99 {:.1}  max {:.1}",
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.99)),
        ms(latencies.last().copied().unwrap_or(0))
    );
    let p99s: Vec<String> = per_second
        .iter_mut()
        .map(|v| {
            v.sort_unstable();
            format!("{:.0}", ms(percentile(v, 0.99)))
        })
        .collect();
    println!("p99 ms by second   {}", p99s.join(" "));
    println!(
        "API memory (RSS)   idle {} MiB, {} subscribers {} MiB, peak {} MiB",
        rss_idle / 1024,
        subscribers,
        rss_connected / 1024,
        rss_peak / 1024
    );
    println!(
        "API CPU            {:.2} s over the {:.1} s run ({:.0}% of one core)",
        cpu,
        delivered_in.as_secs_f64(),
        100.0 * cpu / delivered_in.as_secs_f64()
    );
    println!("slow-subscriber fallbacks {fallbacks}");
}
