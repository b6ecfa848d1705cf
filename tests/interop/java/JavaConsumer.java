import com.taobao.metamorphosis.Message;
import com.taobao.metamorphosis.client.MetaMessageSessionFactory;
import com.taobao.metamorphosis.client.consumer.ConsumerConfig;
import com.taobao.metamorphosis.client.consumer.MessageConsumer;
import com.taobao.metamorphosis.client.consumer.MessageListener;

import java.nio.charset.StandardCharsets;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.Executor;
import java.util.concurrent.TimeUnit;

/**
 * A plain Metaq 1.4 consumer:
 * {@code JavaConsumer <zkConnect> <group> <topic> <n> <timeoutSeconds>} subscribes, prints
 * {@code SUBSCRIBED}, then one {@code GOT <partition> <msgId> <body>} line per message; after
 * {@code n} messages (or the timeout) it shuts the consumer down, which commits the group's
 * offsets to ZooKeeper, prints {@code COMMITTED} and exits 0 (2 on timeout, 1 on error).
 * A new group starts at each partition's beginning (Metaq's default offset 0).
 */
public class JavaConsumer {
    public static void main(String[] args) throws Exception {
        String zkConnect = args[0];
        String group = args[1];
        String topic = args[2];
        int n = Integer.parseInt(args[3]);
        long timeoutSeconds = Long.parseLong(args[4]);
        MetaMessageSessionFactory factory = Interop.factory(zkConnect);
        int status = 1;
        try {
            ConsumerConfig cc = new ConsumerConfig(group);
            cc.setMaxDelayFetchTimeInMills(100);   // an empty partition is re-polled quickly
            cc.setCommitOffsetPeriodInMills(200);
            MessageConsumer consumer = factory.createConsumer(cc);
            final CountDownLatch latch = new CountDownLatch(n);
            consumer.subscribe(topic, 1024 * 1024, new MessageListener() {
                @Override
                public void recieveMessages(Message m) {
                    Interop.out("GOT " + m.getPartition() + " " + m.getId() + " "
                            + new String(m.getData(), StandardCharsets.UTF_8));
                    latch.countDown();
                }

                @Override
                public Executor getExecutor() {
                    return null;
                }
            });
            consumer.completeSubscribe();
            Interop.out("SUBSCRIBED");
            boolean all = latch.await(timeoutSeconds, TimeUnit.SECONDS);
            if (!all) {
                Interop.out("TIMEOUT " + (n - latch.getCount()) + " of " + n);
            }
            consumer.shutdown();
            Interop.out("COMMITTED");
            status = all ? 0 : 2;
        } catch (Throwable t) {
            Interop.error(t);
        } finally {
            factory.shutdown();
        }
        System.exit(status);
    }
}
