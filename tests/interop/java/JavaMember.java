import com.taobao.metamorphosis.Message;
import com.taobao.metamorphosis.client.MetaClientConfig;
import com.taobao.metamorphosis.client.MetaMessageSessionFactory;
import com.taobao.metamorphosis.client.consumer.ConsumerConfig;
import com.taobao.metamorphosis.client.consumer.MessageConsumer;
import com.taobao.metamorphosis.client.consumer.MessageListener;

import java.nio.charset.StandardCharsets;
import java.util.concurrent.Executor;

/**
 * A long-running member of a consumer group, with Metaq's default fetch settings:
 * {@code JavaMember <zkConnect> <group> <topic> <consumerId> <zkSessionTimeoutMs> [<zkSyncTimeMs>]}
 * subscribes, prints {@code SUBSCRIBED}, then one {@code GOT <partition> <msgId> <body>} line
 * per message until its stdin ends (or gives a line): then it shuts the consumer down (which
 * commits its offsets and releases its partitions), prints {@code COMMITTED} and exits 0.
 * Killed with SIGKILL, it leaves its ZooKeeper session to expire.  {@code consumerId} "-"
 * lets Metaq make one up ({@code <ip>-<pid>-<uuid>}); {@code zkSyncTimeMs} is the pause between
 * its rebalance attempts (Metaq's default 5000).  The consumer's log lines (rebalances,
 * fetch runners, connections) go to stderr at INFO.
 */
public class JavaMember {
    public static void main(String[] args) throws Exception {
        String zkConnect = args[0];
        String group = args[1];
        String topic = args[2];
        String consumerId = args[3];
        int sessionTimeoutMs = Integer.parseInt(args[4]);
        int syncTimeMs = args.length > 5 ? Integer.parseInt(args[5]) : -1;
        org.apache.log4j.Logger.getLogger("com.taobao.metamorphosis.client")
                .setLevel(org.apache.log4j.Level.INFO);
        org.apache.log4j.Logger.getLogger("com.taobao.gecko").setLevel(org.apache.log4j.Level.INFO);
        MetaClientConfig cfg = Interop.config(zkConnect);
        cfg.getZkConfig().zkSessionTimeoutMs = sessionTimeoutMs;
        if (syncTimeMs > 0) {
            cfg.getZkConfig().zkSyncTimeMs = syncTimeMs;
        }
        MetaMessageSessionFactory factory = new MetaMessageSessionFactory(cfg);
        int status = 1;
        try {
            ConsumerConfig cc = new ConsumerConfig(group);
            if (!"-".equals(consumerId)) {
                cc.setConsumerId(consumerId);
            }
            MessageConsumer consumer = factory.createConsumer(cc);
            consumer.subscribe(topic, 1024 * 1024, new MessageListener() {
                @Override
                public void recieveMessages(Message m) {
                    Interop.out("GOT " + m.getPartition() + " " + m.getId() + " "
                            + new String(m.getData(), StandardCharsets.UTF_8));
                }

                @Override
                public Executor getExecutor() {
                    return null;
                }
            });
            consumer.completeSubscribe();
            Interop.out("SUBSCRIBED");
            Interop.awaitInput();
            consumer.shutdown();
            Interop.out("COMMITTED");
            status = 0;
        } catch (Throwable t) {
            Interop.error(t);
        } finally {
            factory.shutdown();
        }
        System.exit(status);
    }
}
